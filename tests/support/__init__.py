"""Test doubles of the suite, apart from the shipped package: raw hostile frames (`hostile`) and a shared-memory
stand-in for CUDA IPC (`shm_ipc`). Importable as `support` from the tests (pytest puts tests/ on sys.path) and,
for the stand-in, from the test driver's processes (`shm_ipc.IPC_STANDIN` puts tests/ on their PYTHONPATH)."""
