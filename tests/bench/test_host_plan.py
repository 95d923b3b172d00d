"""bench/transfer/host_plan.py on CPU: every case goes through the transport's real checks and route with a
backend that copies nothing, the NCCL path's cases through the real checks of a header (each asserts its chunk
passes them), the conclusions through a real control channel (every message arrives), and the JSON names the
machine and the engine timed."""
import json

from bench.transfer import host_plan
from sglang_p2p_backend.engine.transport import cuda_ipc


def test_host_plan_times_every_case_through_the_transport(tmp_path, monkeypatch):
    routes = []
    monkeypatch.setattr(host_plan.NoCopy, "write_copy_engines", lambda self, *a, **k: routes.append("copy_engine"))
    monkeypatch.setattr(host_plan.NoCopy, "write_pages", lambda self, *a, **k: routes.append("kernel"))
    monkeypatch.setattr(host_plan.NoCopy, "write_split", lambda self, *a, **k: routes.append("split"))
    out = tmp_path / "hp.json"
    assert host_plan.main(["--out", str(out), "--batches", "1", "--calls", "3"]) == 0
    doc = json.loads(out.read_text())
    assert doc["machine"].startswith("cpu-") and doc["engine_root"] == "this repository"
    nccl = [f"{c[0]}_{step}" for c in host_plan.NCCL_CASES
            for step in ("sender_before_header", "decode_check_first", "decode_check_later", "decode_all_arrived")]
    conclude = [c[0] for c in host_plan.CONCLUDE_CASES]
    assert [r["case"] for r in doc["rows"]] == [c[0] for c in host_plan.CASES] + nccl + conclude
    assert all(r["us_best"] > 0 and len(r["us_batches"]) == 1 for r in doc["rows"])
    # each conclusion's aux row read from SGLang's own buffers: the draft model's hidden states set its size
    rows = {r["case"]: r for r in doc["rows"]}
    assert rows["conclude_hidden16"]["aux_row_bytes"] < rows["conclude_hidden7168_keyed"]["aux_row_bytes"]
    assert [rows[c]["keyed"] for c in conclude] == [False, True, True]
    assert all(rows[c]["zmq_frames"] == [1] for c in conclude)  # a registered pair's messages go as one frame
    assert all(rows[c]["zmq_sends"] == 1 and rows[c]["cold_mib"] == 0 for c in conclude)  # aux row and Status: one
    # 203 writes a case (200 warm-up, 3 timed): the contiguous ones across GPUs on the copy engines; the scattered
    # ones, the same-GPU one (under 16 MiB a region), the 128-token one and the 4k mixed one (runs of 768 pages
    # of 2 KiB, under the 2 MiB a span) on the kernel; the 16k mixed one split between the two
    assert routes == ["copy_engine"] * 406 + ["kernel"] * 1015 + ["split"] * 203
    assert isinstance(cuda_ipc.backend(), cuda_ipc.CudaBackend)  # the stand-in is removed again


def test_host_plan_times_the_conclusions_alone_and_cold(tmp_path):
    out = tmp_path / "hp.json"
    assert host_plan.main(["--out", str(out), "--batches", "1", "--calls", "3", "--only", "conclude",
                           "--cold-mib", "1"]) == 0
    rows = json.loads(out.read_text())["rows"]
    names = [c[0] for c in host_plan.CONCLUDE_CASES]
    assert [r["case"] for r in rows] == names + [f"{n}_cold" for n in names]
    assert [r["cold_mib"] for r in rows] == [0] * len(names) + [1] * len(names)
    assert all(r["us_best"] > 0 and r["zmq_sends"] == 1 for r in rows)


def test_the_evictor_writes_every_cache_line_of_its_buffer():
    evict = host_plan.Evictor(1)
    evict()
    evict()
    assert int(evict._big[::64].min()) == 2 and int(evict._big.sum()) == 2 * (1 << 20) // 64
