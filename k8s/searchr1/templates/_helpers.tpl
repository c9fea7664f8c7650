{{/* Names: trimmed to 40 characters so that "-inference-headless" still fits 63. */}}
{{- define "searchr1.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (.Values.nameOverride | default .Chart.Name) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "searchr1.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ .Values.nameOverride | default .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "retriever") */}}
{{- define "searchr1.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Values.nameOverride | default .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "searchr1.componentLabels" -}}
{{ include "searchr1.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "searchr1.image" -}}
{{- printf "%s:%s" .image.repository (.image.tag | default .root.Chart.AppVersion) -}}
{{- end -}}

{{- define "searchr1.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "searchr1.fullname" .)) -}}
{{- end -}}

{{/* PVC of a shared volume: (dict "root" $ "name" "models") */}}
{{- define "searchr1.claimName" -}}
{{- $p := get .root.Values.persistence .name -}}
{{- $p.existingClaim | default (printf "%s-%s" (include "searchr1.fullname" .root) .name) -}}
{{- end -}}

{{/* Pod annotations: config checksum (a config change rolls the pods) + Prometheus scraping. */}}
{{- define "searchr1.podAnnotations" -}}
checksum/config: {{ include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum }}
{{- if .root.Values.metrics.annotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/* Environment every searchr1 container gets: the config file and the admin token. */}}
{{- define "searchr1.commonEnv" -}}
- name: SEARCHR1_CONFIG
  value: /etc/searchr1/config.yaml
- name: SEARCHR1_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "searchr1.secretName" . }}
      key: admin-token
{{- end -}}

{{/* SEARCHR1_REDIS__URL: the chart's Redis (password from the Secret) or an external URL. */}}
{{- define "searchr1.redisEnv" -}}
{{- if .Values.redis.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "searchr1.secretName" . }}
      key: redis-password
- name: SEARCHR1_REDIS__URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s-redis:%d/0" (include "searchr1.fullname" .) (int .Values.redis.port) | quote }}
{{- else }}
- name: SEARCHR1_REDIS__URL
  valueFrom:
    secretKeyRef:
      name: {{ include "searchr1.secretName" . }}
      key: redis-url
{{- end }}
{{- end -}}

{{/* User-supplied extra environment of a component (a map). */}}
{{- define "searchr1.extraEnv" -}}
{{- range $k, $v := . }}
- name: {{ $k }}
  value: {{ $v | toString | quote }}
{{- end }}
{{- end -}}

{{/* Resources with `gpus` NVIDIA GPUs added to requests and limits: (dict "c" .Values.x) */}}
{{- define "searchr1.resources" -}}
{{- $r := deepCopy (.c.resources | default dict) -}}
{{- $gpus := int (.c.gpus | default 0) -}}
{{- if gt $gpus 0 -}}
{{- $_ := set $r "requests" (merge (dict "nvidia.com/gpu" $gpus) ($r.requests | default dict)) -}}
{{- $_ := set $r "limits" (merge (dict "nvidia.com/gpu" $gpus) ($r.limits | default dict)) -}}
{{- end -}}
{{- toYaml $r -}}
{{- end -}}

{{/* httpGet probes on the service's own port: /health (alive) and /ready (dependencies). */}}
{{- define "searchr1.httpProbes" -}}
startupProbe:
  httpGet: {path: {{ .liveness | default "/health" }}, port: http}
  periodSeconds: 10
  failureThreshold: {{ div (int (.startupSeconds | default 300)) 10 }}
livenessProbe:
  httpGet: {path: {{ .liveness | default "/health" }}, port: http}
  periodSeconds: 15
  timeoutSeconds: 5
  failureThreshold: 4
readinessProbe:
  httpGet: {path: {{ .readiness | default "/ready" }}, port: http}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
{{- end -}}

{{- define "searchr1.podSpecCommon" -}}
automountServiceAccountToken: false
{{- with .root.Values.images.pullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
securityContext: {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .c.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .c.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .c.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Colocated placement (placement: colocated): the stack-level settings it needs (stack.config
checks them together), in every searchr1 container so that each one's view of the stack is a
valid one. (dict "root" $ "trainer" true): without the push settings, which the trainer
container sets itself. */}}
{{- define "searchr1.placementEnv" -}}
- name: SEARCHR1_PLACEMENT
  value: colocated
- name: SEARCHR1_ORCHESTRATOR__MODE
  value: sync
{{- if not .trainer }}
- name: SEARCHR1_TRAINER__WEIGHT_PUSH__MODE
  value: handover
- name: SEARCHR1_TRAINER__WEIGHT_PUSH__RELEASE_ENGINES_WHILE_TRAINING
  value: "true"
{{- end }}
{{- end -}}

{{/* Engine URLs, one per inference pod (stable StatefulSet DNS names), as a JSON list.
Colocated placement: one per engine container of every trainer pod (Indexed Job DNS names,
port inference.port + j). */}}
{{- define "searchr1.engineUrls" -}}
{{- $full := include "searchr1.fullname" . -}}
{{- $urls := list -}}
{{- if eq .Values.placement "colocated" -}}
{{- range $i := until (int .Values.trainer.nodes) -}}
{{- range $j := until (int $.Values.colocated.enginesPerNode) -}}
{{- $urls = append $urls (printf "http://%s-trainer-%d.%s-trainer:%d" $full $i $full (add (int $.Values.inference.port) $j)) -}}
{{- end -}}
{{- end -}}
{{- else -}}
{{- range $i := until (int .Values.inference.replicas) -}}
{{- $urls = append $urls (printf "http://%s-inference-%d.%s-inference:%d" $full $i $full (int $.Values.inference.port)) -}}
{{- end -}}
{{- end -}}
{{- toJson $urls -}}
{{- end -}}
