"""Kubernetes pod discovery (--service-discovery) against a stand-in API server on 127.0.0.1 that speaks
the pod list/watch protocol (tests/lb/kube_api_standin.py says why no real kube-apiserver), with simulated
SGLang workers as the pods: the LB started with the flags the Kubernetes renderer gives it finds the
leader pods by label, reads the bootstrap port from the annotation (the decode reaches the prefill's
bootstrap server through it, so a wrong port fails the request), serves through them, takes a new group
and drops a deleted pod without a restart, lists again after 410 Gone, and survives a refusing API server."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import aiohttp
import pytest

from kube_api_standin import ApiStandin
from lb_harness import FAST_SIM, run, wait_until
from sglang_p2p_backend.launch.config import load_config
from sglang_p2p_backend.launch.k8s import discovery_args
from sglang_p2p_backend.launch.k8s_pod import BOOTSTRAP_ANNOTATION, LEADER_LABEL
from sglang_p2p_backend.launch.k8s_profile import kube_spec
from sglang_p2p_lb import discovery
from sglang_p2p_lb.cli import build_parser, config_from_args
from sglang_p2p_lb.server import LoadBalancer
from simworker import SimConfig, SimWorker

REPO = Path(__file__).resolve().parents[2]
NS = "pd"
INSTANCE = {"app.kubernetes.io/instance": "p3x3-d4"}
PREFILL = {**INSTANCE, "app.kubernetes.io/component": "prefill"}
DECODE = {**INSTANCE, "app.kubernetes.io/component": "decode"}
LEADER = {LEADER_LABEL: "true"}


def rendered_lb_args(api: str, port: int) -> list[str]:
    """The LB's discovery flags exactly as `launch k8s` renders them for p3x3-d4, pointed at the stand-in."""
    cfg = load_config(REPO / "configs/topologies/p3x3-d4.yaml")
    args = discovery_args(cfg, kube_spec(cfg, "0.5.23", namespace=NS))
    args[args.index("--service-discovery-port") + 1] = str(port)
    return [*args, "--service-discovery-api-server", api, "--host", "127.0.0.1", "--port", "0",
            "--health-check-interval-secs", "0.1", "--health-success-threshold", "1", "--load-poll-interval-secs", "0"]


async def sim(role: str, host: str, port: int = 0) -> SimWorker:
    w = SimWorker(SimConfig(role=role, host=host, port=port, **FAST_SIM))
    await w.start()
    return w


def registered(lb: LoadBalancer) -> dict[tuple[str, str], tuple[int | None, bool]]:
    return {(w.role, w.url): (w.bootstrap_port, w.healthy) for w in lb.pool}


def recording_pool():
    """A pool for discovery.run without an LB: (role, url) -> bootstrap port, and its add/remove callbacks."""
    pool: dict[tuple[str, str], int | None] = {}

    async def add(role, url, port):
        pool[(role, url)] = port

    async def remove(role, url):
        pool.pop((role, url))

    return pool, add, remove


async def generate(http: aiohttp.ClientSession, url: str) -> int:
    async with http.post(url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}) as r:
        await r.read()
        return r.status


def test_lb_finds_leader_pods_serves_and_follows_the_cluster_without_restarting(tmp_path):
    async def body():
        api = ApiStandin(token="sa-token")
        await api.start()
        token = tmp_path / "token"
        token.write_text("sa-token\n")
        p0 = await sim("prefill", "127.0.0.2")
        port = p0.cfg.port  # discovery dials every pod on one port, as SGLang pods all serve on theirs
        d0 = await sim("decode", "127.0.0.3", port)
        p1 = await sim("prefill", "127.0.0.4", port)
        workers = [p0, d0, p1]
        await api.add_pod("p3x3-d4-prefill-0-0", {**PREFILL, **LEADER}, "127.0.0.2",
                          annotations={BOOTSTRAP_ANNOTATION: str(p0.cfg.bootstrap_port)})
        await api.add_pod("p3x3-d4-prefill-0-0-1", PREFILL, "127.0.0.9")  # a worker node: not the server
        await api.add_pod("p3x3-d4-decode-0-0", {**DECODE, **LEADER}, "127.0.0.3")
        await api.add_pod("other-decode-0", {**DECODE, **LEADER}, "127.0.0.3", namespace="elsewhere")
        cfg = config_from_args(build_parser().parse_args(rendered_lb_args(api.url, port)))
        cfg.discovery = dataclasses.replace(cfg.discovery, token_path=str(token), backoff=(0.05,))
        lb = LoadBalancer(cfg)
        url = await lb.start()
        http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        try:
            first = {("prefill", f"http://127.0.0.2:{port}"): (p0.cfg.bootstrap_port, True),
                     ("decode", f"http://127.0.0.3:{port}"): (None, True)}
            assert await wait_until(lambda: registered(lb) == first)
            assert await generate(http, url) == 200 and d0.stats.requests == 1

            # a new prefill group's leader comes up: registered while the LB keeps serving
            await api.add_pod("p3x3-d4-prefill-1-0", {**PREFILL, **LEADER}, None, phase="Pending",
                              annotations={BOOTSTRAP_ANNOTATION: str(p1.cfg.bootstrap_port)})
            await asyncio.sleep(0.3)
            assert registered(lb) == first  # not running yet, no IP: not a worker
            await api.modify_pod("p3x3-d4-prefill-1-0", phase="Running", podIP="127.0.0.4")
            second = {**first, ("prefill", f"http://127.0.0.4:{port}"): (p1.cfg.bootstrap_port, True)}
            assert await wait_until(lambda: registered(lb) == second)

            # the first prefill's pod is deleted: only the new one serves, through its own bootstrap port
            await api.delete_pod("p3x3-d4-prefill-0-0")
            third = {k: v for k, v in second.items() if k[1] != f"http://127.0.0.2:{port}"}
            assert await wait_until(lambda: registered(lb) == third)
            before = p1.stats.requests
            for _ in range(3):
                assert await generate(http, url) == 200
            assert p1.stats.requests == before + 3 and lb.cfg.port == int(url.rsplit(":", 1)[1])

            # every request carried the service account token and the rendered selectors
            assert {path for path, _ in api.requests} == {f"/api/v1/namespaces/{NS}/pods"}
            assert {q["labelSelector"] for _, q in api.requests} == {
                "app.kubernetes.io/instance=p3x3-d4,app.kubernetes.io/component=prefill,sglang-p2p-backend/leader=true",
                "app.kubernetes.io/instance=p3x3-d4,app.kubernetes.io/component=decode,sglang-p2p-backend/leader=true"}
            watches = [q for _, q in api.requests if q.get("watch") == "1"]
            assert watches and all(q["allowWatchBookmarks"] == "true" and q["resourceVersion"] for q in watches)
        finally:
            await http.close()
            await lb.stop()
            for w in workers:
                await w.stop()
            await api.stop()

    run(body)


@pytest.mark.parametrize("gone_status", [False, True], ids=["error-event", "http-410"])
def test_410_gone_lists_again_and_catches_up(gone_status):
    """Changes that fell out of the watch window (a deleted pod, a new one) are found by listing again."""
    async def body():
        api = ApiStandin(gone_status=gone_status)
        await api.start()
        pool, add, remove = recording_pool()
        cfg = discovery.DiscoveryConfig(selectors={"prefill": PREFILL, "decode": DECODE}, port=30000, namespace=NS,
                                        api_server=api.url, token_path=None, backoff=(0.05,))
        await api.add_pod("p-a", PREFILL, "10.0.0.1", annotations={BOOTSTRAP_ANNOTATION: "8998"})
        await api.add_pod("d-a", DECODE, "10.0.0.2")
        watchers: list[discovery.PodWatcher] = []
        task = asyncio.create_task(discovery.run(cfg, add, remove, watchers))
        try:
            assert await wait_until(lambda: pool == {("prefill", "http://10.0.0.1:30000"): 8998,
                                                     ("decode", "http://10.0.0.2:30000"): None})
            await api.delete_pod("p-a", record=False)  # never seen by the watch
            api.log.clear()
            await api.compact()
            await api.add_pod("p-b", PREFILL, "fd00::5", annotations={BOOTSTRAP_ANNOTATION: "9000"})
            assert await wait_until(lambda: pool == {("prefill", "http://[fd00::5]:30000"): 9000,
                                                     ("decode", "http://10.0.0.2:30000"): None})
            assert [w.lists for w in watchers] == [2, 2]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await api.stop()

    run(body)


def test_untrusted_pod_fields_are_checked():
    cfg = discovery.DiscoveryConfig(selectors={"prefill": {}, "decode": {}}, port=30000, namespace=NS)

    def pod(ip="10.0.0.1", phase="Running", annotations=None, deleting=False):
        meta = {"uid": "u", "name": "p", "annotations": annotations or {}}
        if deleting:
            meta["deletionTimestamp"] = "2026-11-25T10:00:00Z"
        return {"metadata": meta, "status": {"phase": phase, "podIP": ip}}

    assert discovery.pod_endpoint(pod(annotations={BOOTSTRAP_ANNOTATION: "8998"}), "prefill", cfg) == ("http://10.0.0.1:30000", 8998)
    assert discovery.pod_endpoint(pod(), "prefill", cfg) == ("http://10.0.0.1:30000", None)  # decode uses its default
    assert discovery.pod_endpoint(pod(annotations={BOOTSTRAP_ANNOTATION: "70000"}), "prefill", cfg) is None
    assert discovery.pod_endpoint(pod(annotations={BOOTSTRAP_ANNOTATION: "x; rm"}), "prefill", cfg) is None
    assert discovery.pod_endpoint(pod(ip="evil.example.com"), "decode", cfg) is None
    assert discovery.pod_endpoint(pod(ip="127.0.0.1/8"), "decode", cfg) is None
    assert discovery.pod_endpoint(pod(phase="Succeeded"), "decode", cfg) is None
    assert discovery.pod_endpoint(pod(deleting=True), "decode", cfg) is None
    assert discovery.pod_endpoint(["not", "a", "pod"], "decode", cfg) is None


def test_a_refusing_api_server_is_retried_and_a_rotated_token_is_read_again(tmp_path):
    async def body():
        api = ApiStandin(token="new-token")
        await api.start()
        token = tmp_path / "token"
        token.write_text("expired-token")
        pool, add, remove = recording_pool()
        await api.add_pod("d-a", DECODE, "10.0.0.2")
        cfg = discovery.DiscoveryConfig(selectors={"decode": DECODE}, port=30000, namespace=NS, api_server=api.url,
                                        token_path=str(token), backoff=(0.05, 0.1))
        task = asyncio.create_task(discovery.run(cfg, add, remove))
        try:
            assert await wait_until(lambda: len(api.requests) >= 3)  # refused (401) and retried, not dead
            assert pool == {} and not task.done()
            token.write_text("new-token")  # the kubelet rotated the projected token
            assert await wait_until(lambda: pool == {("decode", "http://10.0.0.2:30000"): None})
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await api.stop()

    run(body)


@pytest.mark.parametrize("argv,needle", [
    (["--service-discovery"], "needs --prefill-selector and --decode-selector"),
    (["--service-discovery", "--prefill-selector", "a=b", "--decode-selector", "a=c"], "--service-discovery-api-server"),
    (["--service-discovery", "--prefill-selector", "role", "--decode-selector", "a=b"], "--prefill-selector expects key=value"),
    (["--service-discovery", "--prefill-selector", "a=b", "--decode-selector", "a=c", "--service-discovery-port", "0"], "out of range"),
    ([], "need at least one --prefill and one --decode"),
])
def test_discovery_flags_are_checked(argv, needle, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match=needle):
        config_from_args(build_parser().parse_args(argv))


def test_outside_a_pod_the_api_server_must_be_named():
    with pytest.raises(ValueError, match="--service-discovery-api-server"):
        discovery.in_cluster_api_server({})
    assert discovery.in_cluster_api_server({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}) == "https://10.96.0.1:443"
