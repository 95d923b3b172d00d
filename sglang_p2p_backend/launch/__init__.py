"""Renders and runs the SGLang and load-balancer command lines of a PD topology described in configs/.

`config` loads a topology YAML with the model and cluster profiles it names, `validate` finds what would
stop the topology at run time, `render` turns it into command lines (pure, no SGLang import), `release`
holds the few flag spellings that differ between supported SGLang releases, `sglang_parser` checks the
rendered commands with SGLang's own argument parser (plugin loaded), `identity` works out which node this
process is, `k8s` renders the topology as Kubernetes objects (LeaderWorkerSet per group) with
`k8s_profile` (the cluster profile's `kubernetes:` section), `lws` (what LWS and the kubelet make of a
LeaderWorkerSet) and `k8s_output` (YAML), and `cli` (`python -m sglang_p2p_backend.launch`) ties them together.
"""
