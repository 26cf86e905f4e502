{{- define "tandem.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tandem.labels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* A tag that is a whole number (`--set image.tag=2`, or unquoted in a values file, which
helm reads as a float) is written as one. */}}
{{- define "tandem.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if and (kindIs "float64" $tag) (eq $tag (float64 (int64 $tag))) -}}
{{- $tag = int64 $tag -}}
{{- end -}}
{{ .Values.image.repository }}:{{ $tag | toString }}
{{- end -}}

{{/* The LeaderWorkerSet's name: not the Service's, since the LWS controller makes a headless
Service of its own name, whose DNS records give $(LWS_LEADER_ADDRESS); at most 44 characters,
since its StatefulSets (NAME, NAME-GROUP) put their name and a 10-character hash in a pod label
of at most 63. */}}
{{- define "tandem.groupName" -}}
{{- printf "%s-nodes" (include "tandem.fullname" . | trunc 38 | trimSuffix "-") -}}
{{- end -}}

{{/* Pod labels and annotations: the selector's and the user's (every pod template). */}}
{{- define "tandem.podMetadata" -}}
labels:
  {{- include "tandem.selectorLabels" . | nindent 2 }}
  {{- with .Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "tandem.apiKeySecret" -}}
{{- .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "tandem.fullname" .)) -}}
{{- end -}}

{{- define "tandem.curveSecret" -}}
{{- .Values.remoteEngine.curve.existingSecret | default (printf "%s-curve" (include "tandem.fullname" .)) -}}
{{- end -}}

{{- define "tandem.apiKeyEnabled" -}}
{{- if or .Values.apiKey.value .Values.apiKey.existingSecret -}}true{{- end -}}
{{- end -}}

{{/* The flags every `tandem serve` of this chart takes (the leader's too, in multi-node mode). */}}
{{- define "tandem.serveArgs" -}}
- --host
- {{ .Values.host | quote }}
- --port
- {{ .Values.service.port | quote }}
- --model
- {{ required "model.path is required (--model: a folder under model.mountPath, or \"default\")" .Values.model.path | quote }}
- --engine-start-timeout  # as long as the startupProbe waits for the model to load
- {{ mul .Values.probes.startup.periodSeconds .Values.probes.startup.failureThreshold | quote }}
{{- with .Values.model.servedModelName }}
- --served-model-name
- {{ . | quote }}
{{- end }}
{{- if .Values.remoteEngine.enabled }}
- --engine
- {{ required "remoteEngine.engineAddress is required with remoteEngine.enabled" .Values.remoteEngine.engineAddress | quote }}
- --curve-secret-key
- /etc/tandem/curve/frontend.key_secret
- --curve-server-key
- /etc/tandem/curve/engine.key
{{- else }}
{{- include "tandem.checkGpus" . }}
{{- if not .Values.gpu.count }}
- --device  # else a CUDA image takes GPUs the pod sees but did not ask for
- cpu
{{- end }}
- --tensor-parallel-size
- {{ .Values.tensorParallelSize | quote }}
{{- if ne (int .Values.pipelineParallelSize) 1 }}
- --pipeline-parallel-size
- {{ .Values.pipelineParallelSize | quote }}
{{- end }}
{{- end }}
{{- with .Values.tracing.otlpTracesEndpoint }}
- --otlp-traces-endpoint
- {{ . | quote }}
{{- end }}
{{- with .Values.metricsNameAlias }}
- --metrics-name-alias
- {{ . | quote }}
{{- end }}
{{- with .Values.cors.allowedOrigins }}
- --allowed-origins
- {{ toJson . | quote }}
{{- with $.Values.cors.allowedMethods }}
- --allowed-methods
- {{ toJson . | quote }}
{{- end }}
{{- with $.Values.cors.allowedHeaders }}
- --allowed-headers
- {{ toJson . | quote }}
{{- end }}
{{- if $.Values.cors.allowCredentials }}
- --allow-credentials
{{- end }}
{{- end }}
{{- end -}}

{{/* The API key, for the pods that serve HTTP (the Deployment's, the LWS leader): a flag
whose value Kubernetes expands from the container's environment, which takes it from the
Secret. A multi-node worker serves no HTTP and gets neither. */}}
{{- define "tandem.apiKeyArgs" -}}
{{- if include "tandem.apiKeyEnabled" . }}
- --api-key
- $(TANDEM_API_KEY)
{{- end }}
{{- end -}}

{{- define "tandem.apiKeyEnv" -}}
{{- if include "tandem.apiKeyEnabled" . }}
- name: TANDEM_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.apiKeySecret" . }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
{{- end -}}

{{/* Environment, volume mounts and volumes shared by every pod. */}}
{{- define "tandem.env" -}}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The environment of a pod that serves HTTP: the API key's variable too. */}}
{{- define "tandem.servingEnv" -}}
{{ include "tandem.apiKeyEnv" . }}
{{ include "tandem.env" . }}
{{- end -}}

{{- define "tandem.volumeMounts" -}}
- name: shm
  mountPath: /dev/shm
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- range include "tandem.secretFolders" . | fromYamlArray }}
- name: {{ .name }}
  mountPath: /etc/tandem/{{ .folder }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* The Secrets tandem reads as files, each as (volume name, Secret, folder under /etc/tandem). */}}
{{- define "tandem.secretFolders" -}}
{{- if .Values.remoteEngine.enabled }}
- {name: curve, secret: {{ include "tandem.curveSecret" . | quote }}, folder: curve}
{{- end }}
{{- if .Values.multiNode.enabled }}
- {name: dist-secret, secret: {{ include "tandem.distSecret" . | quote }}, folder: dist}
{{- end }}
{{- end -}}

{{/* tandem refuses a key or secret file that others may read (mode 0400 or 0600), and a
Secret volume's files are root's, or group-readable under an fsGroup: this copies them, as the
pod's user with mode 0400, into memory volumes that the tandem container mounts. */}}
{{- define "tandem.initContainers" -}}
{{- $folders := include "tandem.secretFolders" . | fromYamlArray -}}
{{- if $folders }}
initContainers:
  - name: secret-files
    image: {{ include "tandem.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command:
      - sh
      - -c
      - umask 077{{ range $folders }} && cp -L /etc/tandem/secrets/{{ .folder }}/* /etc/tandem/{{ .folder }}/{{ end }}
    resources:  # a namespace whose quota asks every container for limits admits it
      requests: {cpu: 10m, memory: 16Mi}
      limits: {cpu: 100m, memory: 64Mi}
    {{- with .Values.securityContext }}
    securityContext:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      {{- range $folders }}
      - name: {{ .name }}-source
        mountPath: /etc/tandem/secrets/{{ .folder }}
        readOnly: true
      - name: {{ .name }}
        mountPath: /etc/tandem/{{ .folder }}
      {{- end }}
{{- end }}
{{- end -}}

{{- define "tandem.volumes" -}}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shmSizeLimit }}
{{- with .Values.model.volume }}
- name: model
{{ toYaml . | indent 2 }}
{{- end }}
{{- range include "tandem.secretFolders" . | fromYamlArray }}
- name: {{ .name }}-source  # read by the init container only, whatever the pod's user
  secret:
    secretName: {{ .secret }}
    defaultMode: 0444
- name: {{ .name }}  # the copies tandem reads (tandem.initContainers)
  emptyDir:
    medium: Memory
    sizeLimit: 1Mi
{{- end }}
{{- end -}}

{{- define "tandem.resources" -}}
{{- $resources := deepCopy .Values.resources -}}
{{- if and .Values.gpu.count (not .Values.remoteEngine.enabled) -}}
{{- $limits := get $resources "limits" | default dict -}}
{{- $_ := set $limits .Values.gpu.resourceName .Values.gpu.count -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{- define "tandem.probes" -}}
startupProbe:
  httpGet:
    path: /health
    port: http
  periodSeconds: {{ .Values.probes.startup.periodSeconds }}
  failureThreshold: {{ .Values.probes.startup.failureThreshold }}
  timeoutSeconds: {{ .Values.probes.startup.timeoutSeconds }}
readinessProbe:
  httpGet:
    path: /health
    port: http
  periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
  failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
  timeoutSeconds: {{ .Values.probes.readiness.timeoutSeconds }}
livenessProbe:
  httpGet:
    path: /health
    port: http
  periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
  failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
  timeoutSeconds: {{ .Values.probes.liveness.timeoutSeconds }}
{{- end -}}

{{- define "tandem.podSpecCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
{{ toYaml . }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
{{ toYaml . | indent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
{{ toYaml . }}
{{- end }}
{{- with .Values.affinity }}
affinity:
{{ toYaml . | indent 2 }}
{{- end }}
{{- with .Values.podSecurityContext }}
securityContext:
{{ toYaml . | indent 2 }}
{{- end }}
{{- with .Values.serviceAccountName }}
serviceAccountName: {{ . | quote }}
{{- end }}
{{- with .Values.runtimeClassName }}
runtimeClassName: {{ . | quote }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . | quote }}
{{- end }}
terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
{{- include "tandem.initContainers" . }}
{{- end -}}

{{/* The multi-node flags; LWS sets the two variables in each pod. */}}
{{- define "tandem.multiNodeArgs" -}}
{{- $ranks := mul (int .root.Values.tensorParallelSize) (int .root.Values.pipelineParallelSize) -}}
{{- if mod $ranks (int .root.Values.multiNode.nodes) -}}
{{- if eq (int .root.Values.pipelineParallelSize) 1 -}}
{{- fail (printf "tensorParallelSize %d must be a multiple of multiNode.nodes %d (each node runs tensorParallelSize / nodes ranks)" (int .root.Values.tensorParallelSize) (int .root.Values.multiNode.nodes)) -}}
{{- end -}}
{{- fail (printf "tensorParallelSize %d x pipelineParallelSize %d must be a multiple of multiNode.nodes %d (each node runs an equal share of the ranks)" (int .root.Values.tensorParallelSize) (int .root.Values.pipelineParallelSize) (int .root.Values.multiNode.nodes)) -}}
{{- end }}
- --nnodes
- {{ .root.Values.multiNode.nodes | quote }}
- --node-rank
- {{ .rank | quote }}
- --master-addr
- $(LWS_LEADER_ADDRESS)
- --master-port
- {{ .root.Values.multiNode.masterPort | quote }}
- --dist-secret-file
- /etc/tandem/dist/{{ .root.Values.multiNode.secret.secretKey }}
{{- end -}}

{{- define "tandem.distSecret" -}}
{{- .Values.multiNode.secret.existingSecret | default (printf "%s-dist" (include "tandem.fullname" .)) -}}
{{- end -}}

{{/* One engine's ranks (tensor x pipeline parallel) need a GPU each: the pod's (all the
group's pods'). */}}
{{- define "tandem.checkGpus" -}}
{{- $pods := ternary (int .Values.multiNode.nodes) 1 .Values.multiNode.enabled -}}
{{- $gpus := mul (int .Values.gpu.count) $pods -}}
{{- $ranks := mul (int .Values.tensorParallelSize) (int .Values.pipelineParallelSize) -}}
{{- if and .Values.gpu.count (gt $ranks (int $gpus)) -}}
{{- if eq (int .Values.pipelineParallelSize) 1 -}}
{{- fail (printf "tensorParallelSize %d needs %d GPUs, but gpu.count gives the engine %d" (int .Values.tensorParallelSize) $ranks (int $gpus)) -}}
{{- end -}}
{{- fail (printf "tensorParallelSize %d x pipelineParallelSize %d needs %d GPUs, but gpu.count gives the engine %d" (int .Values.tensorParallelSize) (int .Values.pipelineParallelSize) $ranks (int $gpus)) -}}
{{- end -}}
{{- end -}}
