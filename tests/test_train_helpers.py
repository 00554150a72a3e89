"""The processes the tests start (tests/train_helpers.py run_python / start_python) behave as `python ...` would:
forked from a server that has imported jax, torch and transformers, each still gets its own environment (JAX's
devices and XLA flags read there, not in the server), working directory, argv, output, exit code and signals."""

import signal
import subprocess
import textwrap

from tests.train_helpers import ROOT, run_python, start_python, train_env, wait_until

SCRIPT = textwrap.dedent("""
    import logging, os, sys
    logging.basicConfig(format="LOG %(levelname)s %(message)s")
    logging.warning("to stderr")
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "marker", os.environ.get("JAXPPO_HELPER_MARKER"))
    if sys.argv[1] == "jax":
        import jax
        print("devices", jax.device_count())
    elif sys.argv[1] == "raise":
        raise RuntimeError("uncaught")
    elif sys.argv[1] == "wait":
        open(sys.argv[2], "w").close()
        import time
        time.sleep(600)
    sys.exit(int(sys.argv[-1]) if sys.argv[-1].isdigit() else 0)
""")


def test_a_script_gets_its_own_argv_cwd_env_output_and_exit_code(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    res = run_python(str(script), "plain", "3", env=train_env(JAXPPO_HELPER_MARKER="m1"), check=False)
    assert res.returncode == 3
    assert f"argv ['plain', '3'] cwd {ROOT} marker m1" in res.stdout
    assert res.stderr.strip() == "LOG WARNING to stderr"  # the script's logging set-up, not the server's imports'
    res = run_python(str(script), "raise", check=False)
    assert res.returncode == 1 and "RuntimeError: uncaught" in res.stderr and "Traceback" in res.stderr


def test_jax_in_a_started_process_reads_that_process_environment(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    for devices in (1, 3):
        assert f"devices {devices}" in run_python(str(script), "jax", env=train_env(devices)).stdout


def test_a_module_runs_as_main_and_output_joins_on_request(tmp_path):
    data = tmp_path / "d.json"
    data.write_text('{"b": 1, "a": [2]}')
    res = run_python("-m", "json.tool", "--sort-keys", str(data))
    assert res.returncode == 0 and res.stdout.index('"a"') < res.stdout.index('"b"')
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    proc = start_python(str(script), "plain", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and err is None and "LOG WARNING to stderr" in out and "argv ['plain']" in out


def test_a_started_process_takes_signals_by_its_own_pid(tmp_path):
    script, ready = tmp_path / "s.py", tmp_path / "ready"
    script.write_text(SCRIPT)
    proc = start_python(str(script), "wait", str(ready))
    wait_until(ready.exists, proc, "the script to start", timeout=120)
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
