"""Look inside a real model: what attention does while a GPT reads and generates.

One forward pass, recorded (:func:`trace`), and what can be read from it: the tutorials' steps on
real heads (:meth:`Trace.steps`), attention rollout (:func:`rollout`), the logit lens
(:func:`logit_lens`), head roles (:func:`head_scores`), ablation (:func:`ablate`,
:func:`ablation_effect`), generation token by token (:func:`trace_generation`) and next-token
probabilities under temperature/top-k/top-p (:func:`next_token_probabilities`, the same filter as
generation). Every weight comes from the model's own ``return_weights`` path; nothing here computes
a second softmax.

:func:`inspector_data` gathers all of it for the inspector page (:func:`render_page`, the file
``attnlab viz --out page.html`` writes); in Jupyter a :class:`Trace` shows that page inline::

    from attnlab.interpret import trace, rollout, logit_lens, head_scores
    tr = trace(model, idx, stages=True, tokenizer=tok)
    tr                      # the inspector, in a notebook
    rollout(tr)[0, -1]      # how much each token flows into the last one
"""

from attnlab.interpret.ablation import AblationEffect, ablate, ablation_effect, parse_heads
from attnlab.interpret.analysis import (
    HEAD_KINDS,
    LogitLens,
    all_head_scores,
    head_scores,
    logit_lens,
    next_token_probabilities,
    repeated_tokens,
    rollout,
)
from attnlab.interpret.inspector import inspector_data, maps_data, records_data, token_label, token_strings
from attnlab.interpret.page import notebook_html, read_asset, read_page_data, render_page, save_page
from attnlab.interpret.playback import GenerationStep, GenerationTrace, trace_generation
from attnlab.interpret.tracing import STEP_NAMES, Trace, attention_layers, observe_attention, record_module, trace

__all__ = [
    "HEAD_KINDS",
    "STEP_NAMES",
    "AblationEffect",
    "GenerationStep",
    "GenerationTrace",
    "LogitLens",
    "Trace",
    "ablate",
    "ablation_effect",
    "all_head_scores",
    "attention_layers",
    "head_scores",
    "inspector_data",
    "logit_lens",
    "maps_data",
    "next_token_probabilities",
    "notebook_html",
    "observe_attention",
    "parse_heads",
    "read_asset",
    "read_page_data",
    "record_module",
    "records_data",
    "render_page",
    "repeated_tokens",
    "rollout",
    "save_page",
    "token_label",
    "token_strings",
    "trace",
    "trace_generation",
]
