"""The operator's two faces: Kubernetes (kopf handlers, pods and API objects) and local
(broker processes on this machine). Both drive brokers through the same executor and admin
API client."""
