"""sglang_p2p_lb: a load-aware HTTP load balancer for SGLang prefill/decode (PD) disaggregation.

Drop-in for SGLang's mini_lb and the PD mode of sgl-router / smg; see docs/lb.md.
"""

__version__ = "0.1.0"
