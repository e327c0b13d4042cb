"""Look inside a real model: what attention does while a GPT reads and generates.

One forward pass, recorded (:func:`trace`), and what can be read from it: the tutorials' steps on
real heads (:meth:`Trace.steps`), attention rollout (:func:`rollout`), the logit lens
(:func:`logit_lens`), head roles (:func:`head_scores`), ablation (:func:`ablate`,
:func:`ablation_effect`), generation token by token (:func:`trace_generation`) and next-token
probabilities under temperature/top-k/top-p (:func:`next_token_probabilities`, the same filter as
generation). Every weight comes from the model's own ``return_weights`` path; nothing here computes
a second softmax.

Sparse autoencoders and transcoders: :class:`SAE` (SAELens's, sparsify's and Gemma Scope's files),
:func:`splice` (an SAE at its hook, its latents readable and editable) and :func:`evaluate_sae`.

From looking to explaining: hook points with TransformerLens's names (:func:`hooks`,
:func:`run_with_cache`), activation, path and attribution patching (:func:`activation_patching`,
:func:`path_patching`, :func:`attribution_patching`) and direct logit attribution
(:func:`direct_logit_attribution`); circuits: edge attribution patching, EAP and EAP-IG
(:func:`edge_attribution`), and the faithfulness of a circuit (:func:`faithfulness`,
:func:`faithfulness_curve`).

The inspector's patching view (:func:`patching_data`; :func:`notebook_patching_html` in Jupyter) draws
activation patching as heatmaps; the circuit view (:func:`circuit_result`; :func:`notebook_circuit_html`
in Jupyter) draws the edges :func:`edge_attribution` finds as a graph.

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
    AnswerRank,
    LogitLens,
    all_head_scores,
    answer_ranks,
    head_scores,
    logit_lens,
    next_token_probabilities,
    repeated_tokens,
    rollout,
)
from attnlab.interpret.attribution import LogitAttribution, direct_logit_attribution
from attnlab.interpret.circuit_view import CircuitResult, circuit_page, circuit_result, notebook_circuit_html
from attnlab.interpret.circuits import (
    MIB_BUDGETS,
    Circuit,
    EdgeGraph,
    EdgeScores,
    FaithfulnessCurve,
    circuit_metrics,
    edge_attribution,
    faithfulness,
    faithfulness_curve,
)
from attnlab.interpret.hooks import (
    ActivationCache,
    AddedPoints,
    AttentionCall,
    HookPoint,
    act_name,
    added_points,
    attention_hooks,
    hook_names,
    hooks,
    run_with_cache,
)
from attnlab.interpret.inspector import inspector_data, maps_data, records_data, token_label, token_strings
from attnlab.interpret.page import notebook_html, read_asset, read_page_data, render_page, save_page
from attnlab.interpret.patch_view import notebook_patching_html, patching_data, patching_page, patching_section
from attnlab.interpret.patching import (
    SITES,
    LogitDiff,
    activation_patching,
    attribution_patching,
    logit_diff,
    normalized_logit_diff,
    path_patching,
)
from attnlab.interpret.playback import GenerationStep, GenerationTrace, trace_generation
from attnlab.interpret.prefix import KeptTrace, retrace, shared_prefix
from attnlab.interpret.sae import SAE, SAEConfig, SAEEvaluation, evaluate_sae, sae_point, splice, steer
from attnlab.interpret.tracing import (
    STEP_NAMES,
    AttentionRecord,
    Trace,
    attention_layers,
    attention_rows,
    observe_attention_rows,
    record_module,
    rows_of,
    trace,
)

__all__ = [
    "HEAD_KINDS",
    "MIB_BUDGETS",
    "SAE",
    "SITES",
    "STEP_NAMES",
    "AblationEffect",
    "ActivationCache",
    "AddedPoints",
    "AnswerRank",
    "AttentionCall",
    "AttentionRecord",
    "Circuit",
    "CircuitResult",
    "EdgeGraph",
    "EdgeScores",
    "FaithfulnessCurve",
    "GenerationStep",
    "GenerationTrace",
    "HookPoint",
    "KeptTrace",
    "LogitAttribution",
    "LogitDiff",
    "LogitLens",
    "SAEConfig",
    "SAEEvaluation",
    "Trace",
    "ablate",
    "ablation_effect",
    "act_name",
    "activation_patching",
    "added_points",
    "all_head_scores",
    "answer_ranks",
    "attention_hooks",
    "attention_layers",
    "attention_rows",
    "attribution_patching",
    "circuit_metrics",
    "circuit_page",
    "circuit_result",
    "direct_logit_attribution",
    "edge_attribution",
    "evaluate_sae",
    "faithfulness",
    "faithfulness_curve",
    "head_scores",
    "hook_names",
    "hooks",
    "inspector_data",
    "logit_diff",
    "logit_lens",
    "maps_data",
    "next_token_probabilities",
    "normalized_logit_diff",
    "notebook_circuit_html",
    "notebook_html",
    "notebook_patching_html",
    "observe_attention_rows",
    "parse_heads",
    "patching_data",
    "patching_page",
    "patching_section",
    "path_patching",
    "read_asset",
    "read_page_data",
    "record_module",
    "records_data",
    "render_page",
    "repeated_tokens",
    "retrace",
    "rollout",
    "rows_of",
    "run_with_cache",
    "sae_point",
    "save_page",
    "shared_prefix",
    "splice",
    "steer",
    "token_label",
    "token_strings",
    "trace",
    "trace_generation",
]
