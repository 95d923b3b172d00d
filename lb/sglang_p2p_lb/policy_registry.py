"""The policies by name: what `--policy`, `--prefill-policy` and `--decode-policy` build.

It imports both policy modules: prefix_policy.py builds on policy.py, so a registry in policy.py would
import it back (a cycle).
"""

from __future__ import annotations

import random

from .policy import LoadAwareParams, LoadAwarePolicy, Policy, PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy, SplitPolicy
from .prefix_policy import CacheAwarePolicy, PrefixAwarePolicy, PrefixParams

POLICIES = ("load_aware", "prefix_aware", "cache_aware", "random", "round_robin", "power_of_two")


def make_policy(name: str, rng: random.Random | None = None, params: LoadAwareParams | None = None, prefix: PrefixParams | None = None) -> Policy:
    """One of POLICIES; `params` tunes the load scoring, `prefix` the prefix-cache policies."""
    if name == "load_aware":
        return LoadAwarePolicy(params, rng)
    if name == "prefix_aware":
        return PrefixAwarePolicy(prefix, params, rng)
    if name == "cache_aware":
        return CacheAwarePolicy(prefix, params, rng)
    if name == "random":
        return RandomPolicy(rng)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "power_of_two":
        return PowerOfTwoPolicy(rng)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")


def make_pd_policy(policy: str, prefill_policy: str | None = None, decode_policy: str | None = None, prefix: PrefixParams | None = None,
                   rng: random.Random | None = None) -> Policy:
    """`--policy` for both sides unless `--prefill-policy` / `--decode-policy` name another (smg's rule)."""
    pp, dp = prefill_policy or policy, decode_policy or policy
    if pp == dp:
        return make_policy(pp, rng, prefix=prefix)
    return SplitPolicy(make_policy(pp, rng, prefix=prefix), make_policy(dp, rng, prefix=prefix))
