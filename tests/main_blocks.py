"""Run one script's main block once per argument list, all in this one process: what a user's
`python SCRIPT ARGS...` does, less the interpreter's start-up each time (a torch import costs
seconds; the bad-input checks under test cost milliseconds). Each run's file descriptors 1 and
2 go to files, so whatever it writes (Python or C++) is kept, and an uncaught exception prints
its traceback and exits 1 as the interpreter would.

    python tests/main_blocks.py SCRIPT CASES.json RESULTS.json

CASES.json: a list of argument lists. RESULTS.json: per case, its exit code, stdout, stderr
and seconds."""

import json
import os
import runpy
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run_main(script, args):
    """(exit code, stdout, stderr) of the script's `if __name__ == "__main__":` block run with args."""
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        sys.argv = [str(ROOT / script), *args]
        try:
            runpy.run_path(str(ROOT / script), run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])
        out.seek(0), err.seek(0)
        return code, out.read().decode(errors="replace"), err.read().decode(errors="replace")


if __name__ == "__main__":
    script, cases, results = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    os.chdir(ROOT)
    done = []
    for args in json.loads(cases.read_text()):
        start = time.monotonic()
        code, out, err = run_main(script, args)
        done.append({"returncode": code, "stdout": out, "stderr": err, "seconds": time.monotonic() - start})
    results.write_text(json.dumps(done))
