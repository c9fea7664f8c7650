{{/* Ingress from networkPolicy.metricsFrom peers on one port: (dict "peers" list "port" int) */}}
{{- define "searchr1.metricsIngress" -}}
{{- if .peers }}
- from: {{- toYaml .peers | nindent 4 }}
  ports:
    - {port: {{ .port }}, protocol: TCP}
{{- end }}
{{- end -}}

{{/* Writable scratch under a read-only root filesystem: /tmp (temporary files, the SGLang
launcher's private config) and $HOME (~/.cache: Hugging Face, Triton, torch compile). */}}
{{- define "searchr1.scratchMounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: home, mountPath: /home/searchr1}
{{- end -}}

{{- define "searchr1.scratchVolumes" -}}
- name: tmp
  emptyDir: {sizeLimit: {{ .Values.security.scratch.tmpSize }}}
- name: home
  emptyDir: {sizeLimit: {{ .Values.security.scratch.homeSize }}}
{{- end -}}
