"""One of two processes of tests/test_engine.py::test_two_processes_match_one."""

import pickle
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(ckpt, coordinator, rank, out):
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=2, process_id=int(rank),
                               heartbeat_timeout_seconds=900)  # the suite keeps both cores busy beside it

    from jaxppo.sharding import make_mesh
    from tests.engine_case import B, run_case

    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rows = slice(int(rank) * B // 2, (int(rank) + 1) * B // 2)  # this process's half of the global batch
    result = run_case(ckpt, mesh, micro_per_device=1, process_rows=rows)
    with open(out, "wb") as f:
        pickle.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
