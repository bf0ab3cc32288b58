{{/* Names: "canopy" for a release named canopy (the plain install), else "<release>-canopy".
     At most 46 characters, so that every name made from it fits: "-operator-metrics" (a
     Service, 63 at most) is the longest suffix, and a CronJob's name ("-miner") may have 52. */}}
{{- define "canopy.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "canopy.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 46 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 46 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 46 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "canopy.operator.fullname" -}}
{{- printf "%s-operator" (include "canopy.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "canopy.miner.fullname" -}}
{{- printf "%s-miner" (include "canopy.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "canopy.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "canopy.operator.fullname" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- required "operator.serviceAccount.name is required when operator.serviceAccount.create is false" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "canopy.miner.serviceAccountName" -}}
{{- if .Values.miner.serviceAccount.create }}
{{- default (include "canopy.miner.fullname" .) .Values.miner.serviceAccount.name }}
{{- else }}
{{- required "miner.serviceAccount.name is required when miner.serviceAccount.create is false" .Values.miner.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Labels on every object: the chart's, and the release's (or a component's selector labels). */}}
{{- define "canopy.metaLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: canopy
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "canopy.labels" -}}
{{ include "canopy.metaLabels" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Selector labels of a component's pods: (dict "root" $ "component" "operator"|"miner").
     The NetworkPolicy admits the operator's and the miner's pods by these. */}}
{{- define "canopy.selectorLabels" -}}
app.kubernetes.io/name: {{ include "canopy.name" .root }}-{{ .component }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end }}

{{- define "canopy.componentLabels" -}}
{{ include "canopy.metaLabels" .root }}
{{ include "canopy.selectorLabels" . }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The broker pods the operator creates (labels set by canopy_operator.backends.k8s.pod_manifest). */}}
{{- define "canopy.broker.selector" -}}
matchLabels:
  app.kubernetes.io/name: canopy-broker
  app.kubernetes.io/part-of: canopy
matchExpressions:
  - {key: canopy.dev/overlay, operator: Exists}
{{- end }}

{{/* An image reference: (dict "root" $ "image" .Values.image.operator). */}}
{{- define "canopy.image" -}}
{{- $root := .root -}}
{{- $tag := .image.tag | default $root.Values.image.tag | default $root.Chart.AppVersion -}}
{{- $repo := .image.repository -}}
{{- with $root.Values.image.registry }}{{ $repo = printf "%s/%s" (trimSuffix "/" .) $repo }}{{ end -}}
{{- printf "%s:%s" $repo (toString $tag) -}}
{{- end }}

{{/* The namespaces a NetworkPolicy is rendered in. */}}
{{- define "canopy.networkPolicyNamespaces" -}}
{{- toJson (.Values.networkPolicy.namespaces | default .Values.overlayNamespaces) -}}
{{- end }}

{{/* RBAC rules of the operator: exactly the requests it makes (tests/operator checks them
     against every request the operator sends to the API emulator). */}}
{{- define "canopy.operator.rules" -}}
# Least privilege: exactly the verbs the operator uses (tests/operator/test_k8s_operator.py and,
# for TopologyProposals, test_k8s_proposals.py check this list against every request the
# operator makes to the API emulator).
# The overlays: watched by kopf, which keeps its bookkeeping in annotations (patch);
# the operator reads one before each reconcile (get). It never writes spec.
- apiGroups: [canopy.dev]
  resources: [brokeroverlays]
  verbs: [get, list, watch, patch]
# Status is the operator's only output on the overlay (merge patches).
- apiGroups: [canopy.dev]
  resources: [brokeroverlays/status]
  verbs: [patch]
# TopologyProposals: watched by kopf (bookkeeping annotations: patch); the operator reads
# one before each pass (get) and lists an overlay's open ones when the overlay changes.
# It never writes their spec, nor creates or deletes them (the miner does).
- apiGroups: [canopy.dev]
  resources: [topologyproposals]
  verbs: [get, list, watch, patch]
# Their status: phase, conditions, the exported patch, the plan's progress.
- apiGroups: [canopy.dev]
  resources: [topologyproposals/status]
  verbs: [patch]
# One Pod per broker: created, checked for readiness, listed per overlay, deleted on removal,
# annotated with its node's zone (canopy.dev/zone, read by the broker via the downward API).
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, create, delete, patch]
# The headless Service for broker DNS (created once; owner references clean it up).
- apiGroups: [""]
  resources: [services]
  verbs: [create]
# cert-manager Certificates, for overlays whose spec.security.issuerRef names an Issuer: one
# per broker and one for the client Secret, deleted with their broker.
- apiGroups: [cert-manager.io]
  resources: [certificates]
  verbs: [create, delete]
# Each overlay's NetworkPolicy for its link port (with networkPolicy.enabled; created once,
# owner-referenced).
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [create]
# The overlay's PodDisruptionBudget (maxUnavailable 0: no broker is evicted; the operator
# moves a broker off a drained node itself, loss-free). Created once, owner-referenced.
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [create]
# Nodes: the cordoned ones (spec.unschedulable), to move brokers off them before a drain, and
# each broker's node's zone label. A Role cannot grant this (nodes are cluster-scoped): with
# overlayNamespaces, drains wait for an admin and brokers learn their zone only from Kubernetes'
# own pod topology labels (1.33+).
- apiGroups: [""]
  resources: [nodes]
  verbs: [list]
# Per overlay: the admin token and, with TLS (spec.security, on by default), the CA, one TLS
# Secret per broker and the client Secret; created once and read to talk to the brokers. A
# removed broker's Secret is deleted; one issued by a replaced CA is deleted and made anew.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create, delete]
# The client policy the brokers mount (spec.security.policy); updated when the spec changes.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch]
# Events for every step, invalid specs, failures.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}

{{/* RBAC rules of the miner (`canopy mine --cluster`). */}}
{{- define "canopy.miner.rules" -}}
# The overlays it mines (their spec: brokers, links, self-organisation settings).
- apiGroups: [canopy.dev]
  resources: [brokeroverlays]
  verbs: [get, list]
# Its proposals: filed, read back, and stale ones it filed earlier removed.
- apiGroups: [canopy.dev]
  resources: [topologyproposals]
  verbs: [get, list, create, delete]
# Each overlay's admin-token Secret and client Secret (its ca.crt verifies the brokers' HTTPS),
# to pull telemetry from the brokers' admin APIs.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
{{- end }}

{{/* A ClusterRole + ClusterRoleBinding, or a Role + RoleBinding per overlay namespace.
     (dict "root" $ "name" NAME "serviceAccount" SA "rules" RULES) */}}
{{- define "canopy.rbac" -}}
{{- $root := .root }}
{{- if not $root.Values.overlayNamespaces }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: {{ .name }}
  labels:
    {{- include "canopy.labels" $root | nindent 4 }}
rules:
  {{- .rules | nindent 2 }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: {{ .name }}
  labels:
    {{- include "canopy.labels" $root | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: {{ .name }}
subjects:
  - kind: ServiceAccount
    name: {{ .serviceAccount }}
    namespace: {{ $root.Release.Namespace }}
{{- else }}
{{- range $ns := $root.Values.overlayNamespaces }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: {{ $.name }}
  namespace: {{ $ns }}
  labels:
    {{- include "canopy.labels" $root | nindent 4 }}
rules:
  {{- $.rules | nindent 2 }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: {{ $.name }}
  namespace: {{ $ns }}
  labels:
    {{- include "canopy.labels" $root | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: {{ $.name }}
subjects:
  - kind: ServiceAccount
    name: {{ $.serviceAccount }}
    namespace: {{ $root.Release.Namespace }}
{{- end }}
{{- end }}
{{- end }}

{{/* A ServiceAccount: (dict "root" $ "name" NAME "values" .Values.operator.serviceAccount "automount" BOOL) */}}
{{- define "canopy.serviceAccount" -}}
{{- if .values.create }}
---
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {{ .name }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "canopy.labels" .root | nindent 4 }}
  {{- with .values.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
automountServiceAccountToken: true
{{- end }}
{{- end }}
