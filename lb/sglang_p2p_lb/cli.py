"""Command line: mini_lb / sgl-router / smg compatible flags, then run the server until interrupted."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Sequence

from . import auth, discovery, processes
from .circuit import BreakerConfig
from .health import HealthConfig
from .policy_registry import POLICIES
from .prefix_policy import PrefixParams
from .proxy import ProxyConfig
from .server import LBConfig
from .workers import normalize_url


def _is_port_token(tok: str) -> bool:
    return tok.lower() == "none" or tok.isdigit()


def parse_prefill_groups(groups: Sequence[Sequence[str]] | None) -> list[tuple[str, int | None]]:
    """`--prefill URL [PORT|none]` groups (smg style), also `--prefill URL1 URL2 ...` (old mini_lb style)."""
    out: list[list] = []  # [url, port, port_given]
    for group in groups or []:
        for tok in group:
            if not _is_port_token(tok):
                out.append([normalize_url(tok), None, False])
                continue
            if not out or out[-1][2]:
                raise ValueError(f"bootstrap port {tok!r} does not follow a prefill URL")
            port = None if tok.lower() == "none" else int(tok)
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"bootstrap port {tok} out of range")
            out[-1][1:] = [port, True]
    return [(u, p) for u, p, _ in out]


def parse_nodes(items: Sequence[str] | None) -> dict[str, str]:
    nodes = {}
    for item in items or []:
        url, sep, label = item.rpartition("=")
        if not sep or not url or not label:
            raise ValueError(f"--node expects URL=LABEL, got {item!r}")
        nodes[normalize_url(url)] = label
    return nodes


def default_max_concurrent() -> int:
    """smg's default bound: 1024 requests per available core, at least 4096."""
    return max(4096, 1024 * len(os.sched_getaffinity(0)))


# flags that count something, and their least value
_COUNTS = {
    "--queue-size": 0, "--cb-failure-threshold": 1, "--cb-success-threshold": 1, "--cb-half-open-max-probes": 1,
    "--health-failure-threshold": 1, "--health-success-threshold": 1, "--health-timeout-failure-threshold": 1, "--passive-failure-threshold": 1,
}
# durations that must be positive (`not v > 0` also refuses nan)
_DURATIONS = (
    "--queue-timeout-secs", "--cb-timeout-duration-secs", "--cb-window-duration-secs",
    "--health-check-interval-secs", "--health-check-timeout-secs", "--health-liveness-timeout-secs",
)


def check_limits(args: argparse.Namespace) -> None:
    """A clear error for a count or a duration out of range (each flag's dest is argparse's default)."""
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    for flag, least in _COUNTS.items():
        if (v := getattr(args, flag[2:].replace("-", "_"))) < least:
            raise ValueError(f"{flag} must be >= {least}, got {v}")
    for flag in _DURATIONS:
        if not (v := getattr(args, flag[2:].replace("-", "_"))) > 0:
            raise ValueError(f"{flag} must be > 0, got {v}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sglang-p2p-lb",
        description="Load-aware load balancer for SGLang prefill/decode disaggregation (drop-in for mini_lb and sgl-router/smg PD mode).",
    )
    p.add_argument("--prefill", nargs="+", action="append", metavar="URL [BOOTSTRAP_PORT]", help="prefill server URL and its bootstrap port (repeatable; port 'none' or omitted: decode uses its own default)")
    p.add_argument("--decode", nargs="+", action="append", metavar="URL", help="decode server URL (repeatable)")
    p.add_argument("--prefill-bootstrap-ports", nargs="+", default=None, help="old mini_lb form: one port for all prefills or one per prefill")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0, as mini_lb and smg)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--workers", type=int, default=1, help="server processes sharing --port (SO_REUSEPORT), each with its own routing state; "
                   "more than 1 is for request rates one process (one core) cannot carry. See docs/lb.md, 'Several worker processes'")
    p.add_argument("--policy", choices=POLICIES, default="load_aware", help="pair selection policy (default load_aware)")
    p.add_argument("--prefill-policy", choices=POLICIES, default=None, help="policy that picks the prefill (and its DP rank); default --policy")
    p.add_argument("--decode-policy", choices=POLICIES, default=None, help="policy that picks the decode, given the chosen prefill; default --policy")
    p.add_argument("--node", action="append", metavar="URL=LABEL", help="node (host) label of a worker for pair affinity; default: the URL's host")
    g = p.add_argument_group("prefix-aware policy (sgl-router / smg cache_aware flags)")
    g.add_argument("--cache-threshold", type=float, default=PrefixParams.cache_threshold, help="prefix matches shorter than this share of the prompt are ignored")
    g.add_argument("--balance-abs-threshold", type=int, default=PrefixParams.balance_abs_threshold, help="requests: with --balance-rel-threshold, the imbalance at which cache affinity is dropped for pure load")
    g.add_argument("--balance-rel-threshold", type=float, default=PrefixParams.balance_rel_threshold)
    g.add_argument("--eviction-interval-secs", "--eviction-interval", dest="eviction_interval", type=float, default=PrefixParams.eviction_interval, help="how often each worker's prefix tree is trimmed to --max-tree-size")
    g.add_argument("--max-tree-size", type=int, default=PrefixParams.max_tree_size, help="prefix-tree entries (64-byte prompt blocks) kept per worker")
    g.add_argument("--cached-token-cost", dest="cached_cost", type=float, default=PrefixParams.cached_cost, help="ours (prefix_aware): share of a cached prompt token's cost still charged to the prefill holding it, 0-1 (its KV still leaves that prefill; default 0: a hit is free)")
    g = p.add_argument_group("keys (Authorization: Bearer)")
    g.add_argument("--api-key", default=os.environ.get(auth.API_KEY_ENV), help=f"client key for every route but /health and /metrics; also sent to the workers (env {auth.API_KEY_ENV})")
    g.add_argument("--admin-api-key", default=os.environ.get(auth.ADMIN_KEY_ENV), help=f"key for POST/DELETE /workers and /flush_cache, which are refused without one (env {auth.ADMIN_KEY_ENV})")
    g.add_argument("--control-plane-api-keys", action="append", default=[os.environ[auth.SMG_CONTROL_PLANE_ENV]] if os.environ.get(auth.SMG_CONTROL_PLANE_ENV) else [], metavar="ID:NAME:ROLE:KEY", help=f"smg's form of admin keys (role admin; env {auth.SMG_CONTROL_PLANE_ENV})")
    g = p.add_argument_group("timeouts and limits")
    g.add_argument("--request-timeout-secs", "--request-timeout", dest="request_timeout", type=float, default=1800.0, help="total time for one upstream leg")
    g.add_argument("--first-byte-timeout-secs", dest="first_byte_timeout", type=float, default=ProxyConfig.first_byte_timeout, help="prefill answer and first streamed decode event")
    g.add_argument("--idle-stream-timeout-secs", dest="idle_stream_timeout", type=float, default=ProxyConfig.idle_stream_timeout, help="longest gap between two streamed chunks")
    g.add_argument("--header-timeout-secs", dest="header_timeout", type=float, default=15.0, help="a connection must send its request headers within this (also the keep-alive idle time)")
    g.add_argument("--body-timeout-secs", dest="body_timeout", type=float, default=ProxyConfig.body_timeout, help="a request must send its whole body within this")
    g.add_argument("--connect-timeout-secs", dest="connect_timeout", type=float, default=5.0)
    g.add_argument("--max-retries", type=int, default=2, help="extra attempts on a new pair after a refused/reset connection or a 503, before any byte reached the client")
    g.add_argument("--max-concurrent-requests", type=int, default=-1, help="requests in flight before new ones queue (-1: 1024 per CPU core, at least 4096; 0: unbounded)")
    g.add_argument("--queue-size", type=int, default=ProxyConfig.queue_size, help="requests that may wait for a slot; beyond that a 429 (0: no queue)")
    g.add_argument("--queue-timeout-secs", type=float, default=ProxyConfig.queue_timeout, help="longest wait for a slot, then a 503")
    g.add_argument("--max-body-mb", type=float, default=64.0)
    g = p.add_argument_group("health and load")
    g.add_argument("--health-check-interval-secs", type=float, default=HealthConfig.interval)
    g.add_argument("--health-recovery-interval-secs", type=float, default=HealthConfig.recovery_interval, help="how often a suspect or ejected worker is probed, so a stopped one is found and a restarted one is back quickly (0: --health-check-interval-secs)")
    g.add_argument("--health-check-timeout-secs", type=float, default=HealthConfig.timeout)
    g.add_argument("--health-failure-threshold", type=int, default=HealthConfig.failure_threshold, help="consecutive failed health checks that eject a worker (the last of its role is only marked degraded)")
    g.add_argument("--health-liveness-endpoint", default=HealthConfig.liveness_endpoint, help="answered by SGLang's HTTP process alone: no answer means the worker stopped")
    g.add_argument("--health-liveness-timeout-secs", type=float, default=HealthConfig.liveness_timeout)
    g.add_argument("--health-timeout-failure-threshold", type=int, default=HealthConfig.timeout_failure_threshold, help="consecutive liveness timeouts (with no load-poll answer between) after which a worker counts as stopped: its in-flight requests are retried elsewhere and it is ejected")
    g.add_argument("--health-success-threshold", type=int, default=HealthConfig.success_threshold)
    g.add_argument("--health-check-endpoint", default="/health")
    g.add_argument("--disable-health-check", action="store_true")
    g.add_argument("--passive-failure-threshold", type=int, default=ProxyConfig.passive_failure_threshold, help="consecutive request transport errors that eject a worker")
    g.add_argument("--load-poll-interval-secs", dest="load_poll_interval", type=float, default=1.0, help="poll /v1/loads (or /get_load) this often; 0 disables")
    g.add_argument("--load-max-age-secs", dest="poll_max_age", type=float, default=10.0, help="ignore polled loads older than this")
    g.add_argument("--channel-ttl-secs", type=float, default=600.0, help="a P/D pair used within this time counts as having a live transfer channel")
    g.add_argument("--no-dp-aware", dest="dp_aware", action="store_false", help="never add DP-rank fields (routed_dp_rank, disagg_prefill_dp_rank)")
    g.add_argument("--decision-log", default=None, metavar="PATH", help="append a JSON line per routing decision with what the policy saw of every candidate (PATH.<index> per process with --workers); off by default")
    g = p.add_argument_group("circuit breaker (smg's --cb-* flags)")
    g.add_argument("--cb-failure-threshold", type=int, default=BreakerConfig.failure_threshold, help="consecutive failed legs on a worker that open its circuit")
    g.add_argument("--cb-success-threshold", type=int, default=BreakerConfig.success_threshold, help="successful half-open probes that close it")
    g.add_argument("--cb-timeout-duration-secs", type=float, default=BreakerConfig.timeout, help="an open circuit gets no requests this long, then half-open probes")
    g.add_argument("--cb-window-duration-secs", type=float, default=BreakerConfig.window, help="a failure more than this after the previous one starts the count again")
    g.add_argument("--cb-half-open-max-probes", type=int, default=BreakerConfig.max_probes, help="requests at a time on a half-open worker")
    g.add_argument("--disable-circuit-breaker", action="store_true")
    add_discovery_flags(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    # accepted for command-line compatibility with sglang_router / smg, no effect here
    p.add_argument("--pd-disaggregation", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mini-lb", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dp-aware", action="store_true", help=argparse.SUPPRESS)  # smg's opt-in; on here unless --no-dp-aware
    return p


def add_discovery_flags(p: argparse.ArgumentParser) -> None:
    """smg's Kubernetes service discovery flags (PD mode), plus the API server address for tests."""
    g = p.add_argument_group("Kubernetes pod discovery (smg flags)")
    g.add_argument("--service-discovery", action="store_true", help="add and remove workers as pods matching the selectors run and go")
    g.add_argument("--prefill-selector", nargs="+", metavar="KEY=VALUE", help="labels of the prefill pods to register (all must match)")
    g.add_argument("--decode-selector", nargs="+", metavar="KEY=VALUE", help="labels of the decode pods to register")
    g.add_argument("--service-discovery-port", type=int, default=80, help="HTTP port of every discovered pod (default 80, as smg)")
    g.add_argument("--service-discovery-namespace", help="namespace to watch (default: all, which needs a ClusterRole)")
    g.add_argument("--bootstrap-port-annotation", default=discovery.DEFAULT_ANNOTATION, help="prefill pod annotation holding its bootstrap port")
    g.add_argument("--service-discovery-api-server", default="", help="API server URL (default: in-cluster, from KUBERNETES_SERVICE_HOST)")


def discovery_from_args(args: argparse.Namespace) -> discovery.DiscoveryConfig | None:
    if not args.service_discovery:
        return None
    selectors = {role: discovery.parse_selector(getattr(args, f"{role}_selector"), f"--{role}-selector") for role in ("prefill", "decode")}
    if not all(selectors.values()):
        raise ValueError("--service-discovery needs --prefill-selector and --decode-selector (KEY=VALUE ...)")
    if not 0 < args.service_discovery_port < 65536:
        raise ValueError("--service-discovery-port out of range")
    return discovery.DiscoveryConfig(
        selectors=selectors, port=args.service_discovery_port, namespace=args.service_discovery_namespace,
        bootstrap_annotation=args.bootstrap_port_annotation,
        # resolved here, so a LB started outside a pod without an address stops with the fix at once
        api_server=args.service_discovery_api_server or discovery.in_cluster_api_server(),
    )


def config_from_args(args: argparse.Namespace) -> LBConfig:
    check_limits(args)
    prefills = parse_prefill_groups(args.prefill)
    if args.prefill_bootstrap_ports:
        ports = [None if x.lower() == "none" else int(x) for x in args.prefill_bootstrap_ports]
        if len(ports) == 1:
            ports = ports * len(prefills)
        if len(ports) != len(prefills):
            raise ValueError("--prefill-bootstrap-ports needs one port or one per prefill")
        prefills = [(u, p if p is not None else q) for (u, p), q in zip(prefills, ports)]
    decodes = [normalize_url(u) for group in args.decode or [] for u in group]
    found = discovery_from_args(args)
    if found is None and (not prefills or not decodes):
        raise ValueError("need at least one --prefill and one --decode (more can be added later with POST /workers), or --service-discovery")
    admin_keys = ([args.admin_api_key] if args.admin_api_key else []) + auth.parse_control_plane_keys(args.control_plane_api_keys)
    return LBConfig(
        prefills=prefills,
        decodes=decodes,
        nodes=parse_nodes(args.node),
        host=args.host,
        port=args.port,
        policy=args.policy,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        prefix=PrefixParams(
            cache_threshold=args.cache_threshold,
            balance_abs_threshold=args.balance_abs_threshold,
            balance_rel_threshold=args.balance_rel_threshold,
            eviction_interval=args.eviction_interval,
            max_tree_size=args.max_tree_size,
            cached_cost=args.cached_cost,
        ),
        auth=auth.AuthConfig.from_keys(admin_keys, args.api_key),
        worker_api_key=args.api_key,
        header_timeout=args.header_timeout,
        proxy=ProxyConfig(
            request_timeout=args.request_timeout,
            first_byte_timeout=args.first_byte_timeout,
            idle_stream_timeout=args.idle_stream_timeout,
            body_timeout=args.body_timeout,
            connect_timeout=args.connect_timeout,
            max_retries=args.max_retries,
            max_concurrent=default_max_concurrent() if args.max_concurrent_requests < 0 else args.max_concurrent_requests,
            queue_size=args.queue_size,
            queue_timeout=args.queue_timeout_secs,
            passive_failure_threshold=args.passive_failure_threshold,
            poll_max_age=args.poll_max_age,
            channel_ttl=args.channel_ttl_secs,
            dp_fields=args.dp_aware,
        ),
        health=HealthConfig(
            interval=args.health_check_interval_secs,
            recovery_interval=args.health_recovery_interval_secs,
            timeout=args.health_check_timeout_secs,
            failure_threshold=args.health_failure_threshold,
            timeout_failure_threshold=args.health_timeout_failure_threshold,
            liveness_endpoint=args.health_liveness_endpoint,
            liveness_timeout=args.health_liveness_timeout_secs,
            success_threshold=args.health_success_threshold,
            endpoint=args.health_check_endpoint,
            enabled=not args.disable_health_check,
        ),
        breaker=BreakerConfig(
            failure_threshold=args.cb_failure_threshold,
            success_threshold=args.cb_success_threshold,
            timeout=args.cb_timeout_duration_secs,
            window=args.cb_window_duration_secs,
            max_probes=args.cb_half_open_max_probes,
            enabled=not args.disable_circuit_breaker,
        ),
        load_poll_interval=args.load_poll_interval,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        dp_aware=args.dp_aware,
        discovery=found,
        decision_log=args.decision_log,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    # several processes share the log stream: each line then names its writer's pid
    logging.basicConfig(level=args.log_level.upper(), format=processes.LOG_FORMAT if args.workers == 1 else processes.PROCESS_LOG_FORMAT)
    return processes.run(cfg, args.workers, args.log_level)
