"""A Hugging Face checkpoint as one more layout of the logical tensors.

megatron-core's logical tensors (``sharded_state_dict`` keys, a leading global-layer axis and,
for experts, a global-expert axis) and Hugging Face's tensors hold the same numbers in other
groupings:

* ``linear_qkv`` interleaves by query group: for each group, its query heads' rows, then one key
  head, then one value head; Hugging Face keeps ``q_proj``, ``k_proj`` and ``v_proj`` apart;
* SwiGLU ``linear_fc1`` is ``[gate; up]``: ``gate_proj`` rows then ``up_proj`` rows;
* the word embedding and an untied output layer are padded to ``padded_vocab_size`` rows; the
  padding rows have no Hugging Face counterpart (zeros on import, dropped on export);
* layer norms carry the keys of the linear layer they precede (TransformerEngine's fused
  layernorm-linear naming, which megatron's local spec keeps for its checkpoints).

Every such correspondence is a ``Segment``: rows of one logical tensor at one (layer, expert)
index equal rows of one Hugging Face tensor; columns always agree. A box of a logical tensor
(what a rank holds) is read as the segments it intersects; a Hugging Face tensor is written
from the segments that make it up. Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from liveshard.runtime.spec import ModelSpec

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Segment:
    """Rows ``[row, row + rows)`` of logical ``key`` at ``index`` (layer[, expert]) are rows
    ``[hf_row, hf_row + rows)`` of Hugging Face tensor ``hf_name``."""

    key: str
    index: Shape
    row: int
    rows: int
    hf_name: str
    hf_row: int


@dataclass(frozen=True)
class HFTensor:
    name: str
    shape: Shape
    segments: tuple[Segment, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class LogicalTensor:
    """One (key, index) unit: the logical tensor's slice at one layer (and expert)."""

    key: str
    global_shape: Shape  # with the layer/expert axes
    index: Shape

    @property
    def shape(self) -> Shape:
        return self.global_shape[len(self.index):]


def hf_tensors(spec: ModelSpec) -> list[HFTensor]:
    """Every tensor of the Hugging Face checkpoint of ``spec``, in the order transformers saves them."""
    return [t for t, _ in _walk(spec)]


def logical_units(spec: ModelSpec) -> dict[tuple[str, Shape], LogicalTensor]:
    """Every logical (key, index) the Hugging Face tensors are made of."""
    out: dict[tuple[str, Shape], LogicalTensor] = {}
    for _, units in _walk(spec):
        for u in units:
            out[(u.key, u.index)] = u
    return out


def segments_by_unit(spec: ModelSpec) -> dict[tuple[str, Shape], list[Segment]]:
    out: dict[tuple[str, Shape], list[Segment]] = {}
    for t in hf_tensors(spec):
        for s in t.segments:
            out.setdefault((s.key, s.index), []).append(s)
    for segs in out.values():
        segs.sort(key=lambda s: s.row)
    return out


def reads_for_box(segments: list[Segment], row: int, rows: int) -> Iterator[tuple[Segment, int, int, int]]:
    """The parts of rows ``[row, row + rows)`` of a logical unit that Hugging Face holds:
    ``(segment, hf_row, box_row, count)``. Rows no segment covers (vocabulary padding) are not
    yielded."""
    end = row + rows
    for s in segments:
        lo, hi = max(row, s.row), min(end, s.row + s.rows)
        if lo < hi:
            yield s, s.hf_row + lo - s.row, lo - row, hi - lo


def _walk(spec: ModelSpec) -> Iterator[tuple[HFTensor, list[LogicalTensor]]]:
    h, L = spec.hidden_size, spec.num_layers
    d, heads, groups = spec.kv_channels, spec.num_attention_heads, spec.num_query_groups
    vocab, padded = spec.vocab_size, spec.padded_vocab_size

    def whole(name: str, key: str, shape: Shape, index: Shape = (), prefix: Shape = ()) -> tuple[HFTensor, list[LogicalTensor]]:
        seg = Segment(key, index, 0, shape[0], name, 0)
        return HFTensor(name, shape, (seg,)), [LogicalTensor(key, (*prefix, *shape), index)]

    emb = "embedding.word_embeddings.weight"
    yield (HFTensor("model.embed_tokens.weight", (vocab, h), (Segment(emb, (), 0, vocab, "model.embed_tokens.weight", 0),)),
           [LogicalTensor(emb, (padded, h), ())])
    biases = ("weight", "bias") if spec.add_bias_linear else ("weight",)
    for g in range(L):
        p = f"model.layers.{g}"
        at = "decoder.layers.self_attention"
        yield whole(f"{p}.input_layernorm.weight", f"{at}.linear_qkv.layer_norm_weight", (h,), (g,), (L,))
        # q/k/v: rows of each query group interleaved in linear_qkv
        per_group = heads // groups * d
        stride = per_group + 2 * d
        for suffix in ("weight", "bias") if (spec.add_qkv_bias or spec.add_bias_linear) else ("weight",):
            key = f"{at}.linear_qkv.{suffix}"
            cols: Shape = (h,) if suffix == "weight" else ()
            unit = LogicalTensor(key, (L, spec.qkv_rows, *cols), (g,))
            for proj, offset, n, total in (("q_proj", 0, per_group, heads * d),
                                           ("k_proj", per_group, d, groups * d),
                                           ("v_proj", per_group + d, d, groups * d)):
                name = f"{p}.self_attn.{proj}.{suffix}"
                segs = tuple(Segment(key, (g,), i * stride + offset, n, name, i * n) for i in range(groups))
                yield HFTensor(name, (total, *cols), segs), [unit]
        for suffix in biases:
            shape = (h, spec.query_projection_size) if suffix == "weight" else (h,)
            yield whole(f"{p}.self_attn.o_proj.{suffix}", f"{at}.linear_proj.{suffix}", shape, (g,), (L,))
        if spec.qk_layernorm:
            for which in ("q", "k"):
                yield whole(f"{p}.self_attn.{which}_norm.weight", f"{at}.{which}_layernorm.weight", (d,), (g,), (L,))
        # TransformerEngine's MoE layers keep the pre-MLP norm apart, under its own key
        pre_mlp = ("decoder.layers.pre_mlp_layernorm.weight" if spec.fused_layernorms and spec.is_moe_layer(g)
                   else "decoder.layers.mlp.linear_fc1.layer_norm_weight")
        yield whole(f"{p}.post_attention_layernorm.weight", pre_mlp, (h,), (g,), (L,))
        if spec.is_moe_layer(g):
            yield whole(f"{p}.mlp.gate.weight", "decoder.layers.mlp.router.weight", (spec.num_moe_experts, h), (g,), (L,))
            for e in range(spec.num_moe_experts):
                yield from _mlp(spec, f"{p}.mlp.experts.{e}", "decoder.layers.mlp.experts.experts",
                                spec.moe_ffn_hidden_size, (g, e), (L, spec.num_moe_experts))
        else:
            yield from _mlp(spec, f"{p}.mlp", "decoder.layers.mlp", spec.ffn_hidden_size, (g,), (L,))
    yield whole("model.norm.weight", "decoder.final_layernorm.weight", (h,))
    if not spec.share_embeddings_and_output_weights:
        out = "output_layer.weight"
        yield (HFTensor("lm_head.weight", (vocab, h), (Segment(out, (), 0, vocab, "lm_head.weight", 0),)),
               [LogicalTensor(out, (padded, h), ())])


def _mlp(spec: ModelSpec, prefix: str, key: str, ffn: int, index: Shape, axes: Shape) -> Iterator[tuple[HFTensor, list[LogicalTensor]]]:
    h = spec.hidden_size
    for suffix in ("weight", "bias") if spec.add_bias_linear else ("weight",):
        cols: Shape = (h,) if suffix == "weight" else ()
        fc1 = LogicalTensor(f"{key}.linear_fc1.{suffix}", (*axes, 2 * ffn, *cols), index)
        for proj, row in (("gate_proj", 0), ("up_proj", ffn)):
            name = f"{prefix}.{proj}.{suffix}"
            yield HFTensor(name, (ffn, *cols), (Segment(fc1.key, index, row, ffn, name, 0),)), [fc1]
        shape = (h, ffn) if suffix == "weight" else (h,)
        name = f"{prefix}.down_proj.{suffix}"
        fc2 = LogicalTensor(f"{key}.linear_fc2.{suffix}", (*axes, *shape), index)
        yield HFTensor(name, shape, (Segment(fc2.key, index, 0, shape[0], name, 0),)), [fc2]


__all__ = ["HFTensor", "LogicalTensor", "Segment", "hf_tensors", "logical_units", "reads_for_box", "segments_by_unit"]
