{{/* The chart's name, overridable. */}}
{{- define "liveshard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name: release name, plus the chart name unless it already contains it. */}}
{{- define "liveshard.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "liveshard.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every object of the release carries. */}}
{{- define "liveshard.labels" -}}
helm.sh/chart: {{ include "liveshard.chart" . }}
{{ include "liveshard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels that select the operator's pod (immutable in a Deployment: keep them few). */}}
{{- define "liveshard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "liveshard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "liveshard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "liveshard.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "liveshard.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The Lease the operator replicas elect their leader with (in the release's namespace). */}}
{{- define "liveshard.leaseName" -}}
{{- default (include "liveshard.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{/* The webhook's Service, and the Secret with its serving certificate. */}}
{{- define "liveshard.webhookService" -}}
{{- printf "%s-webhook" (include "liveshard.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "liveshard.webhookSecret" -}}
{{- default (printf "%s-webhook-tls" (include "liveshard.fullname" .)) .Values.webhook.secretName }}
{{- end }}

{{/* Where the operator container finds the webhook certificate. */}}
{{- define "liveshard.webhookCertDir" -}}
/etc/liveshard/webhook
{{- end }}
