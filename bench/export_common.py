"""The export loop that bench/export_torchvision.py, export_hub.py, export_keras.py and
export_paddle.py share, free of any framework (the Keras and Paddle exports run in venvs
without torch)."""
import json
import os
import traceback


def one_line(e):
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg}"[:400]


def rm(path):
    for p in (path, path + ".data", path[: -len(".onnx")] + ".args"):
        if os.path.exists(p):
            os.remove(p)


def export_all(out, jobs):
    """Run ``jobs`` = [(file stem, write(path) -> ttrank args or None)]; each writes
    OUT/<stem>.onnx, and OUT/<stem>.args when recommend needs arguments (bench/exports.py
    passes them). Failures are kept in OUT/export_failures.json, and the rest go on."""
    fails_path = os.path.join(out, "export_failures.json")
    fails = json.load(open(fails_path)) if os.path.exists(fails_path) else {}
    for fname, write in jobs:
        path = os.path.join(out, fname + ".onnx")
        rm(path)
        print(f"[export] {fname}", flush=True)
        try:
            cli = write(path)
            if os.path.exists(path + ".data"):
                raise RuntimeError("exporter wrote external data despite external_data=False")
            if cli:
                with open(path[: -len(".onnx")] + ".args", "w") as f:
                    f.write(" ".join(cli) + "\n")
            fails.pop(fname, None)
            print(f"[ok] {fname} {os.path.getsize(path) / 2**20:.1f} MB", flush=True)
        except Exception as e:  # record and go on
            traceback.print_exc()
            rm(path)
            fails[fname] = {"error": one_line(e)}
            print(f"[FAIL] {fname}: {one_line(e)}", flush=True)
        with open(fails_path + ".tmp", "w") as f:
            json.dump(fails, f, indent=1, sort_keys=True)
        os.replace(fails_path + ".tmp", fails_path)
