"""The 4-GPU miniature shapes (e2e/shape_plan.py, e2e/shape_faults.py): what each starts, that no two shapes
clash when they all start together, the reference's flags, and how fault errors are counted. No GPU needed."""
from pathlib import Path

import pytest

from e2e import shape_faults
from e2e.shape_plan import SHAPES, plan, reference_args
from sglang_p2p_backend.launch.validate import DIST_INIT_PORT_SPAN



def flags(args):
    """--flag -> the values up to the next flag."""
    out, key = {}, None
    for tok in args:
        key = tok if tok.startswith("--") else key
        out.setdefault(key, []).extend([] if tok == key else [tok])
    return out


def all_launches(release="0.5.17"):
    return {name: plan(s, Path("/m") / s.model, release, ["--policy", "round_robin"]) for name, s in SHAPES.items()}


def test_every_shape_starts_its_servers_with_the_launcher_and_a_reference_with_the_decodes_layout():
    launches = all_launches()
    assert set(launches) == {"mini-a-2p-dpdecode", "mini-b-dp-both", "mini-b-deepep", "mini-b-deepep-ll", "mini-c-tp1-tp2", "mini-c-tp2-tp1",
                             "mini-c-tp1-tp4"}
    a = launches["mini-a-2p-dpdecode"]
    assert [l.role for l in a] == ["prefill", "prefill", "decode", "reference", "reference-prefill", "lb"]
    assert [l.role for l in launches["mini-b-dp-both"]] == ["prefill", "decode", "reference", "lb"]  # one layout
    p1 = a[1].argv
    assert p1[1:4] == ["-m", "sglang_p2p_backend.launch", "node"] and p1[p1.index("--rank") + 1] == "1"
    assert (a[1].port, a[1].bootstrap_port, a[1].gpu) == (30101, 8101, 1)
    ref = flags(tuple(a[3].argv[3:]))
    assert a[3].argv[1:3] == ["-m", "sglang.launch_server"]
    assert not any(k.startswith("--disaggregation") for k in ref)
    assert (ref["--tp-size"], ref["--dp-size"], ref["--ep-size"], ref["--port"], ref["--base-gpu-id"]) == (
        ["2"], ["2"], ["2"], ["30190"], ["0"])
    assert ref["--dist-init-addr"] == ["127.0.0.1:5160"] and ref["--chunked-prefill-size"] == ["128"]
    assert dict(a[3].env)["SGLANG_HOST_IP"] == "127.0.0.1"
    ref_p = flags(tuple(a[4].argv[3:]))  # the prefill's layout: TP 1, plain attention, no EP
    assert (ref_p["--tp-size"], ref_p["--port"], ref_p["--dist-init-addr"]) == (["1"], ["30180"], ["127.0.0.1:5140"])
    assert not {"--dp-size", "--ep-size"} & ref_p.keys()
    lb = a[5].argv
    assert lb[lb.index("--") + 1:] == ["--policy", "round_robin", "--port", "8010"]


def test_shapes_started_together_never_share_a_port():
    taken: dict[int, str] = {}
    for name, launches in all_launches().items():
        for l in launches:
            ports = {l.port} | ({l.bootstrap_port} if l.bootstrap_port else set())
            args = l.argv
            if l.role.startswith("reference"):
                dist = int(flags(tuple(args[3:]))["--dist-init-addr"][0].rsplit(":", 1)[1])
                ports |= set(range(dist, dist + DIST_INIT_PORT_SPAN))
            for port in ports:
                assert port not in taken, f"{l.name} and {taken[port]} both take port {port}"
                taken[port] = l.name


def test_the_check_starts_pd_servers_with_kv_digests_and_only_mla_shapes_rely_on_them(tmp_path):
    from e2e.shapes import CORRUPT_VAR, DIGEST_VAR, server_for

    a = all_launches()["mini-a-2p-dpdecode"]
    checked = {l.role: server_for(l, tmp_path / "flag", digest=True).env for l in a}
    assert {role for role, env in checked.items() if env.get(DIGEST_VAR) == "1"} == {"prefill", "decode"}
    assert CORRUPT_VAR in checked["decode"] and CORRUPT_VAR not in checked["prefill"]
    assert not any(DIGEST_VAR in server_for(l, tmp_path / "flag").env for l in a)  # timed runs: off
    assert {n for n, s in SHAPES.items() if s.kv_digest} == {"mini-a-2p-dpdecode", "mini-b-dp-both", "mini-b-deepep", "mini-b-deepep-ll"}


def test_reference_args_drop_pd_flags_and_move_ports():
    args = ("--model-path", "/m", "--port", "1", "--disaggregation-mode", "decode", "--disaggregation-transfer-backend",
            "p2pnccl", "--dist-init-addr", "10.0.0.1:5", "--skip-server-warmup")
    assert reference_args(args, 30190, 5160, 3) == [
        "--model-path", "/m", "--port", "30190", "--dist-init-addr", "10.0.0.1:5160", "--skip-server-warmup",
        "--base-gpu-id", "3"]


def _rec(start, end, ok):
    return {"start": start, "end": end, "ok": ok, "status": None if ok else 503, "detail": "" if ok else "x"}


@pytest.mark.parametrize("left_empty,expected", [(False, (1, 0, 2)), (True, (1, 1, 1))])
def test_fault_errors_are_split_by_when_their_request_was_sent(left_empty, expected):
    records = [_rec(0, 12, False), _rec(1, 2, True), _rec(11, 11.1, False), _rec(40, 41, False), _rec(50, 51, True)]
    out = shape_faults.classify(records, killed_at=10, healthy_at=30, role_left_empty=left_empty)
    assert (out["errors_in_flight"], out["errors_no_server_of_role_left"], out["errors_other"]) == expected
    assert (out["requests"], out["ok"], out["in_flight_at_kill"]) == (5, 2, 1)


def test_every_reference_fits_the_host():
    for launches in all_launches().values():
        for l in launches:
            if l.role.startswith("reference"):
                tp = int(flags(tuple(l.argv[3:]))["--tp-size"][0])
                assert 0 <= l.gpu and l.gpu + tp <= 4, (l.name, l.gpu, tp)


def test_serving_runs_every_backend_on_the_same_rendered_commands_with_moved_ports():
    from e2e import shape_serve
    from e2e.shape_plan import load

    shape = shape_serve.SHAPES["mini-a-serve"]
    cfg = load(shape, Path("/m/deepseek-anchor"))
    p2p, nixl, mooncake = (shape_serve.deployment(shape, cfg, Path("/m/deepseek-anchor"), "0.5.17", b, k)
                           for k, b in enumerate(shape_serve.BACKENDS))
    assert p2p.prefills[1].argv[1:4] == ["-m", "sglang_p2p_backend.launch", "node"]  # the launcher itself
    f = flags(tuple(nixl.prefills[1].argv[3:]))
    assert nixl.prefills[1].argv[1:3] == ["-m", "sglang.launch_server"]
    assert (f["--disaggregation-transfer-backend"], f["--port"], f["--disaggregation-bootstrap-port"],
            f["--dist-init-addr"], f["--base-gpu-id"]) == (["nixl"], ["31601"], ["9601"], ["127.0.0.1:6607"], ["1"])
    d = flags(tuple(mooncake.decode["graph"].argv[3:]))
    assert (d["--disaggregation-transfer-backend"], d["--port"], d["--dist-init-addr"], d["--dp-size"],
            d["--ep-size"], d["--cuda-graph-max-bs-decode"]) == (["mooncake"], ["32610"], ["127.0.0.1:7620"], ["2"],
                                                                  ["2"], ["64"])
    assert mooncake.decode["graph"].env["MC_INTRANODE_NVLINK"] == "true"
    # the rest of the flags are the rendered ones, unchanged
    from sglang_p2p_backend.launch.render import server_command

    moved = ("--disaggregation-transfer-backend", "--port", "--disaggregation-bootstrap-port", "--dist-init-addr")
    rendered = flags(server_command(cfg, cfg.nodes()[1], "0.5.17").args)
    assert {k: v for k, v in f.items() if k not in moved} == {k: v for k, v in rendered.items() if k not in moved}
    lb = nixl.lb["graph"].argv
    assert lb[lb.index("--prefill"):lb.index("--host")] == [
        "--prefill", "http://127.0.0.1:31600", "9600", "--prefill", "http://127.0.0.1:31601", "9601",
        "--decode", "http://127.0.0.1:31610"]


def test_a_variant_of_ours_runs_the_rendered_commands_as_p2pnccl_with_its_knobs_and_ports_of_its_own(capsys):
    """`--backends p2pnccl,p2pnccl-ce,...`: a variant is our backend on the same rendered commands as the peers
    (ports moved by its place in the list), with its knobs in the environment; unknown names are refused."""
    from e2e import serve, shape_serve
    from e2e.shape_plan import load

    shape = shape_serve.SHAPES["mini-a-serve"]
    cfg = load(shape, Path("/m/deepseek-anchor"))
    ce = shape_serve.deployment(shape, cfg, Path("/m/deepseek-anchor"), "0.5.17", "p2pnccl-ce", 3)
    f = flags(tuple(ce.prefills[0].argv[3:]))
    assert ce.prefills[0].argv[1:3] == ["-m", "sglang.launch_server"]
    assert (f["--disaggregation-transfer-backend"], f["--port"], f["--disaggregation-bootstrap-port"]) == (
        ["p2pnccl"], ["33600"], ["11600"])
    for s in ce.servers():
        assert (s.env["SGLANG_P2P_CE_MIN_SPAN_KIB"], s.env["SGLANG_P2P_CE_MAX_SPANS"]) == ("1024", "256")
        assert s.env["SGLANG_P2P_TRANSPORT"] == "auto"
    sm = shape_serve.deployment(shape, cfg, Path("/m/deepseek-anchor"), "0.5.17", "p2pnccl-kernel", 4)
    assert sm.decode["graph"].env["SGLANG_P2P_COPY_ENGINE"] == "off"
    assert "SGLANG_P2P_COPY_ENGINE" not in ce.decode["graph"].env
    ports = [s.port for d in (ce, sm) for s in [*d.servers(), d.lb["graph"]]]
    assert len(ports) == len(set(ports))
    assert set(serve.TRANSFER_BACKEND) <= set(serve.BACKEND_ENV)
    with pytest.raises(SystemExit):
        shape_serve.main(["--models", "/m", "--out", "/tmp/x.json", "--logs", "/tmp/l", "--backends", "p2pnccl,nccl2"])
    assert "--backends: nccl2 not one of p2pnccl, p2pnccl-gil5, p2pnccl-kernel, p2pnccl-ce, p2pnccl-grid132" in capsys.readouterr().err


def test_each_prefills_copy_routes_come_from_its_log(tmp_path):
    """The route lines a prefill logged (its first chunk's, and the other route's first use) land in the result,
    with the last of its periodic tallies; a server without a log, or that logged none, has an empty list."""
    from e2e import shape_serve
    from e2e.servers import Server

    log = tmp_path / "p0.log"
    log.write_text("[2026-11-28] INFO x\n[2026-11-28 TP0] p2pnccl: same-host chunks on the copy engines from now on "
                   "where SGLANG_P2P_COPY_ENGINE=auto picks it (first: 61 spans, 288358400 bytes)\nother\n"
                   "[TP0] p2pnccl: same-host chunks on the routes so far: copy engines 3 chunks (0.80 GiB)\n"
                   "[TP0] p2pnccl: same-host chunks on the routes so far: copy engines 9 chunks (2.41 GiB)\n")
    quiet = tmp_path / "p1.log"
    quiet.write_text("nothing here\n")
    servers = [Server("p0", 1, "prefill", log=log), Server("p1", 2, "prefill", log=quiet), Server("p2", 3, "prefill")]
    assert shape_serve.copy_routes(servers) == {
        "p0": ["p2pnccl: same-host chunks on the copy engines from now on where SGLANG_P2P_COPY_ENGINE=auto picks it "
               "(first: 61 spans, 288358400 bytes)",
               "p2pnccl: same-host chunks on the routes so far: copy engines 9 chunks (2.41 GiB)"],  # the last tally
        "p1": [], "p2": []}
