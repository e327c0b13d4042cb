"""``attnlab serve``: the inspector as a live local web application.

Type a prompt and the inspector's views follow (debounced): every head's attention, the tutorials'
steps of a chosen head, next-token probabilities under temperature/top-k/top-p, rollout, the logit
lens, head roles; "generate" streams tokens one by one with each token's attention; clicking heads
in "ablate" mode shows how the next-token distribution changes without them; the Patching tab runs
activation patching of the prompt and a corrupted one (:mod:`~attnlab.tools.serve.patching`); an instruct model gets a
chat box whose answers open in the inspector (:mod:`~attnlab.tools.serve.chat`); with ``--sae DIR`` the Features tab
shows a token's strongest SAE latents and a latent's dashboard, and steers generations
(:mod:`~attnlab.tools.serve.features`). One front end with the
offline page (the same package-data files of :mod:`attnlab.interpret`), only its data source
differs: here a JSON API that returns what :mod:`attnlab.interpret` computes.

Modules: :mod:`~attnlab.tools.serve.engine` (the model, its lock, the library calls),
:mod:`~attnlab.tools.serve.api` (requests and answers, with limits),
:mod:`~attnlab.tools.serve.app` (the FastAPI application), :mod:`~attnlab.tools.serve.server`
(uvicorn: bind, serve, shut down). Needs the ``serve`` extra: ``pip install 'attnlab[serve]'``.

Library use (an ASGI app to test or mount)::

    from attnlab.tools.loading import load
    from attnlab.tools.serve import Engine, create_app
    app = create_app(Engine(load(checkpoint="runs/tiny")))
"""

from attnlab.tools.serve.app import create_app, live_page
from attnlab.tools.serve.engine import DEFAULT_PROMPT, Engine, GenerationRun, Limits, NotALanguageModel
from attnlab.tools.serve.server import bind, is_loopback, serve

__all__ = [
    "DEFAULT_PROMPT",
    "Engine",
    "GenerationRun",
    "Limits",
    "NotALanguageModel",
    "bind",
    "create_app",
    "is_loopback",
    "live_page",
    "serve",
]
