{{/* Names ------------------------------------------------------------------------------------- */}}

{{- define "kvpilot.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every resource name: the release name, plus the chart name unless already in it. */}}
{{- define "kvpilot.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvpilot.operator.fullname" -}}
{{- printf "%s-operator" (include "kvpilot.fullname" .) }}
{{- end }}

{{- define "kvpilot.autoscaler.fullname" -}}
{{- printf "%s-autoscaler" (include "kvpilot.fullname" .) }}
{{- end }}

{{- define "kvpilot.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "kvpilot.operator.fullname" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvpilot.autoscaler.serviceAccountName" -}}
{{- if .Values.autoscaler.serviceAccount.create }}
{{- default (include "kvpilot.autoscaler.fullname" .) .Values.autoscaler.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.autoscaler.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvpilot.operator.leaseName" -}}
{{- default (include "kvpilot.operator.fullname" .) .Values.operator.leaderElection.leaseName }}
{{- end }}

{{/* The autoscaler's Lease name is fixed in the code (kvpilot.autoscaler.election.LEASE_NAME). */}}
{{- define "kvpilot.autoscaler.leaseName" -}}
kvpilot-autoscaler
{{- end }}

{{/* Labels --------------------------------------------------------------------------------------- */}}

{{- define "kvpilot.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvpilot.labels" -}}
helm.sh/chart: {{ include "kvpilot.chart" . }}
app.kubernetes.io/name: {{ include "kvpilot.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvpilot
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component (operator | autoscaler); never change them: selectors are immutable. */}}
{{- define "kvpilot.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpilot.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvpilot.componentLabels" -}}
{{ include "kvpilot.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Images: registry/repository@digest, else registry/repository:tag (tag defaults to appVersion). */}}
{{- define "kvpilot.image" -}}
{{- $img := .image }}
{{- $repo := $img.repository }}
{{- if $img.registry }}{{ $repo = printf "%s/%s" $img.registry $img.repository }}{{ end }}
{{- if $img.digest }}
{{- printf "%s@%s" $repo $img.digest }}
{{- else }}
{{- printf "%s:%s" $repo (default .ctx.Chart.AppVersion ($img.tag | toString)) }}
{{- end }}
{{- end }}

{{/* Capabilities ---------------------------------------------------------------------------------- */}}

{{/* "true" when the ServiceMonitor should be rendered (explicitly on, or auto and the API exists). */}}
{{- define "kvpilot.serviceMonitor.enabled" -}}
{{- $v := .Values.metrics.serviceMonitor.enabled | toString }}
{{- if or (eq $v "true") (and (eq $v "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor")) }}true{{ end }}
{{- end }}

{{- define "kvpilot.prometheusRule.enabled" -}}
{{- $v := .Values.prometheusRule.enabled | toString }}
{{- if or (eq $v "true") (and (eq $v "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/PrometheusRule")) }}true{{ end }}
{{- end }}

{{/* Pod-level pieces shared by the operator and the autoscaler ----------------------------------- */}}

{{- define "kvpilot.downwardEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: HOME
  value: /tmp
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
{{- end }}

{{- define "kvpilot.validate" -}}
{{- if and .Values.autoscaler.enabled (gt (len .Values.watchNamespaces) 1) }}
{{- fail "autoscaler.enabled needs watchNamespaces to list at most one namespace: `kvpilot autoscaler run` watches one namespace or all (set autoscaler.enabled=false, or leave watchNamespaces empty)" }}
{{- end }}
{{- if and (gt (int .Values.operator.replicas) 1) (not .Values.operator.leaderElection.enabled) }}
{{- fail "operator.replicas > 1 needs operator.leaderElection.enabled=true: two operators without a leader would both write every model" }}
{{- end }}
{{- if and .Values.autoscaler.enabled (gt (int .Values.autoscaler.replicas) 1) (not .Values.autoscaler.leaderElection.enabled) }}
{{- fail "autoscaler.replicas > 1 needs autoscaler.leaderElection.enabled=true: two autoscalers without a leader would both scale every model" }}
{{- end }}
{{- end }}

{{/* Egress every kvpilot pod needs: DNS and the API server. */}}
{{- define "kvpilot.netpol.egressBase" -}}
# DNS
- ports:
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
# the Kubernetes API server
- ports:
    {{- range .Values.networkPolicy.apiServerPorts }}
    - port: {{ . }}
      protocol: TCP
    {{- end }}
  {{- with .Values.networkPolicy.apiServerCIDRs }}
  to:
    {{- range . }}
    - ipBlock:
        cidr: {{ . }}
    {{- end }}
  {{- end }}
{{- end }}

{{- define "kvpilot.router.fullname" -}}
{{- printf "%s-router" (include "kvpilot.fullname" .) }}
{{- end }}

{{/* The namespace whose InferenceModels the router serves (its pods watch and route there). */}}
{{- define "kvpilot.router.namespace" -}}
{{- default .Release.Namespace .Values.router.namespace }}
{{- end }}
