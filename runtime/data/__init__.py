"""Training data: tokenizers, Megatron indexed datasets and how a global batch splits over ranks.

| module | what it holds |
|---|---|
| ``batches.py`` | ``BatchPlan``: one step's fixed global batch over DP ranks and micro-batches (pure) |
| ``tokenizer.py`` | ``load_tokenizer``: Hugging Face ``tokenizer.json`` or SentencePiece, for megatron |
| ``datasets.py`` | the job's train/valid/test datasets through megatron-core's builder, cached once |
| ``prepare.py`` | text → Megatron indexed format (``liveshard prepare-data``) |
| ``corpus.py`` | a small real corpus and BPE tokenizer built from text shipped with Python |
"""
