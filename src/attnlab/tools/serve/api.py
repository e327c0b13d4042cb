"""The JSON API of ``attnlab serve``: requests (checked by pydantic, with limits) and answers.

Arrays in answers are the inspector's packed arrays (:mod:`attnlab.interpret.codec`) inline:
``{"dtype": "f32" | "i32" | "u16" | "u8", "shape": [...], "tri": bool, "b64": "..."}``, little-endian;
``u16``/``u8`` hold ``q / 65535`` or ``q / 255``; ``tri``: the lower triangles of the last two dims,
row by row. ``attnlab.interpret.codec.unpack`` reads them back as tensors.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from attnlab.interpret.inspector import SECTIONS

__all__ = [
    "HARD_MAX_NEW_TOKENS",
    "AblateAnswer",
    "AblateRequest",
    "ChatMessage",
    "ChatRequest",
    "CircuitRequest",
    "FeaturesRequest",
    "GenerateRequest",
    "InfoAnswer",
    "InspectRequest",
    "LatentRequest",
    "NextAnswer",
    "NextRequest",
    "PromptRequest",
    "StatsAnswer",
    "SteerRequest",
    "TokenizeAnswer",
]

HARD_MAX_NEW_TOKENS = 4096  # the schema's bound; the server's own cap (--max-new-tokens) is usually lower
MAX_PROMPT_CHARS = 100_000

Section = Literal["layers", "steps", "next", "rollout", "lens", "roles"]  # = inspector.SECTIONS (a test checks)
HeadName = Annotated[str, Field(pattern=r"^\s*\d{1,4}\.\d{1,4}\s*$", description="a head as 'layer.head', e.g. '0.3'")]
Temperature = Annotated[
    float, Field(ge=0.0, le=1000.0, allow_inf_nan=False, description="softmax temperature; 0 = greedy")
]
TopK = Annotated[int | None, Field(ge=1, le=1 << 20, description="keep the top_k likeliest tokens (null: off)")]
TopP = Annotated[
    float | None, Field(gt=0.0, le=1.0, allow_inf_nan=False, description="keep the top-p nucleus (null: off)")
]
Seed = Annotated[int, Field(ge=0, le=(1 << 63) - 1, description="the sampling generator's seed")]
NewTokens = Annotated[
    int, Field(ge=1, le=HARD_MAX_NEW_TOKENS, description="tokens to generate (at most the server's cap)")
]


class Strict(BaseModel):
    # strict: a number is a JSON number ("1" and true are refused, not converted), no unknown field
    model_config = ConfigDict(extra="forbid", strict=True)


class PromptRequest(Strict):
    prompt: str = Field(
        min_length=1,
        max_length=MAX_PROMPT_CHARS,
        description="the text; its tokens must fit the model's context window",
        examples=["Your journey starts with one step"],
    )


class InspectRequest(PromptRequest):
    """What :func:`attnlab.interpret.inspector_data` computes for the prompt, the sections asked for."""

    sections: list[Section] = Field(
        default=["layers"],
        max_length=len(SECTIONS),
        description="layers (every head's attention), steps (the tutorials' steps of some heads), next "
        "(next-token probabilities at a grid of temperatures), rollout, lens (the logit lens), roles "
        "(head-role scores: the model's, computed once)",
    )
    steps: list[HeadName] | None = Field(
        default=None, max_length=256, description="heads whose tutorials' steps to include (default: auto)"
    )
    layers: list[Annotated[int, Field(ge=-4096, le=4096)]] | None = Field(
        default=None, max_length=4096, description="layers of the heads view (default: all; negative from the end)"
    )
    heads: list[Annotated[int, Field(ge=-4096, le=4096)]] | None = Field(
        default=None, max_length=4096, description="heads of the heads view (default: all)"
    )
    precision: Literal["auto", "f32", "u16", "u8"] = Field(
        default="auto",
        description="how attention weights are stored (auto: the most precise within 16 MiB, else u8)",
    )
    lens_k: int = Field(default=5, ge=1, le=50, description="logit-lens candidates per layer and position")
    lens_window: tuple[Annotated[int, Field(ge=0, strict=True)], Annotated[int, Field(ge=1, strict=True)]] | None = (
        Field(
            default=None,
            strict=False,  # (a JSON array: strict mode takes only a tuple; its numbers stay strict)
            description="the positions [start, stop) of the logit lens (the live page asks for the ones it shows: "
            "the lens costs a whole-vocabulary product per layer and position); default: every position",
        )
    )
    next_k: int = Field(default=32, ge=1, le=256, description="next-token candidates per position")


class NextRequest(PromptRequest):
    """Next-token probabilities after one position, under temperature/top-k/top-p (as generation samples)."""

    position: int = Field(default=-1, ge=-(1 << 20), le=1 << 20, description="the token to predict after (-1: last)")
    temperature: Temperature = 1.0
    top_k: TopK = None
    top_p: TopP = None
    k: int = Field(default=12, ge=1, le=256, description="how many of the likeliest tokens to return")


class AblateRequest(PromptRequest):
    """The effect of removing heads: :func:`attnlab.interpret.ablation_effect`."""

    heads: list[HeadName] = Field(min_length=1, max_length=4096, description="heads to remove, 'layer.head'")
    mode: Literal["zero", "mean"] = Field(default="zero", description="replace a head's output by zeros or its mean")
    temperature: Temperature = 1.0
    top_k: TopK = None
    top_p: TopP = None
    k: int = Field(default=10, ge=1, le=256, description="likeliest tokens before and after to compare")


class GenerateRequest(PromptRequest):
    """A generation streamed token by token (server-sent events)."""

    max_new_tokens: NewTokens = 16
    temperature: Temperature = 1.0
    top_k: TopK = None
    top_p: TopP = None
    seed: Seed = 0
    candidates: int = Field(default=10, ge=1, le=100, description="candidates reported per token")


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=MAX_PROMPT_CHARS)


class ChatRequest(Strict):
    """One assistant turn, streamed (server-sent events): the conversation so far, the user's last."""

    messages: list[ChatMessage] = Field(
        min_length=1,
        max_length=1000,
        description="the conversation, oldest first, ending with the user's message to answer; the oldest "
        "turns are dropped (the system message kept) when it does not fit the context window",
    )
    max_new_tokens: int | None = Field(
        default=None,
        ge=1,
        le=HARD_MAX_NEW_TOKENS,
        description="the longest answer (at most the server's cap; null: the cap, at most half the context window)",
    )
    temperature: Temperature = 0.7
    top_k: TopK = None
    top_p: TopP = None
    seed: Seed = 0


# -- answers (for the documentation; the server fills them from attnlab.interpret) ------------------
class TokenizeAnswer(BaseModel):
    ids: list[int]
    tokens: list[str]
    labels: list[str]


class NextAnswer(BaseModel):
    position: int = Field(description="the position predicted after (resolved from -1)")
    ids: list[int] = Field(description="the likeliest next tokens, most likely first")
    probs: list[float] = Field(description="their probabilities (0 outside top-k / top-p)")
    greedy: bool
    labels: dict[str, str] = Field(description="printable label of each token id")


class AblationRow(BaseModel):
    id: int
    before: float
    after: float


class AblateAnswer(BaseModel):
    heads: list[str]
    mode: str
    loss_before: float | None = Field(description="mean next-token loss over the prompt (nats); null for one token")
    loss_after: float | None
    loss_change: float | None
    kl: float = Field(description="KL(before || after) of the next-token distribution after the last token")
    greedy: bool
    top_before: list[int]
    top_after: list[int]
    rows: list[AblationRow] = Field(description="the likeliest tokens before or after, with both probabilities")
    labels: dict[str, str]


class Limits(BaseModel):
    max_new_tokens: int
    max_body_bytes: int
    max_prompt_chars: int
    max_prompt_tokens: int | None
    max_trace_bytes: int


class SAEInfo(BaseModel):
    index: int
    name: str = Field(description="as given to attnlab serve --sae")
    hook: str
    d_sae: int
    architecture: str
    transcoder: bool


class CorpusInfo(BaseModel):
    name: str
    tokens: int


class InfoAnswer(BaseModel):
    name: str
    language_model: bool = Field(description="false for the tutorials' six-word example (attnlab serve --demo)")
    chat: bool = Field(default=False, description="whether the model has a chat template (the chat box works)")
    model: dict[str, Any] | None
    default_prompt: str
    torch_threads: int = Field(description="the threads torch runs the model on (attnlab serve --threads)")
    limits: Limits
    saes: list[SAEInfo] = Field(default=[], description="the SAEs of the Features tab (attnlab serve --sae DIR)")
    sae_corpus: CorpusInfo | None = Field(
        default=None, description="the corpus latents' dashboards may read (attnlab serve --sae-data FILE)"
    )


class StatsAnswer(BaseModel):
    model_calls: int
    traces: int
    trace_cache_hits: int
    tokens_run: int = Field(description="positions the traces ran the model on (the rest reused or cached)")
    prefix_reuses: int = Field(description="attention passes that ran only the tokens after a recent prompt's prefix")
    tokens_reused: int = Field(description="positions whose attention rows those passes took from the recent prompt")
    generations_started: int
    generations_finished: int
    generations_stopped: int = Field(description="generations ended early because their client left")
    generations_active: int
    generation_steps: int = Field(description="tokens generated, all generations together")
    compiled_generations: int = Field(description="generations and chat answers decoded by the compiled step")
    steps_compiled: int = Field(description="cache sizes of the compiled decoding step ready")
    steps_compiling: int = Field(description="compilations of the decoding step asked for and not done")
    compile_failed: int = Field(description="1 if compiling failed (the server then decodes on the fast path)")


# -- the patching view (attnlab.tools.serve.patching) -------------------------------------------------
PatchSite = Literal["head_out", "resid_pre"]
Answer = Annotated[int, Field(ge=0, le=(1 << 31) - 1)] | Annotated[str, Field(min_length=1, max_length=200)]


class PairRequest(Strict):
    """Two prompts of as many tokens and the two answers whose logit difference is the metric."""

    clean: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS, description="the prompt whose answer is A")
    corrupted: str = Field(
        min_length=1, max_length=MAX_PROMPT_CHARS, description="a prompt of as many tokens whose answer is B"
    )
    answers: list[Answer] = Field(
        min_length=2,
        max_length=2,
        description="A and B: token ids, or texts that are exactly one token each (e.g. ' Paris')",
        examples=[[" Mary", " John"]],
    )


class PatchRequest(PairRequest):
    """Activation patching of two prompts (:func:`attnlab.interpret.activation_patching`), metric
    ``logit(A) - logit(B)`` at the last token."""

    sites: list[PatchSite] = Field(
        default=["head_out", "resid_pre"],
        max_length=2,
        description="head_out: every head's output, (L, H); resid_pre: the residual stream at each layer and "
        "position, (L, T); [] for one head's pattern only",
    )
    head: HeadName | None = Field(default=None, description="also this head's attention pattern on both prompts")


# -- the circuit view (attnlab.tools.circuit.serve_circuit) ---------------------------------------
CircuitMethod = Literal["EAP", "EAP-IG-inputs", "EAP-IG-activations"]


class CircuitRequest(PairRequest):
    """Edge attribution of two prompts (:func:`attnlab.interpret.edge_attribution`), metric
    ``logit(A) - logit(B)`` at the last token, and the faithfulness of its top edges' circuits."""

    method: CircuitMethod = Field(default="EAP", description="EAP, or EAP-IG on the inputs or on the activations")
    ig_steps: int = Field(default=5, ge=1, le=32, description="integrated-gradient steps of EAP-IG")
    budget: str | float = Field(
        default="5%", description="the circuit drawn: its share of all edges, as '5%' or 0.05, in (0, 1]"
    )


# -- the Features tab (attnlab.tools.serve.features) ----------------------------------------------------
SAEIndex = Annotated[int, Field(ge=0, le=1023, description="which SAE of the server (the order of --sae)")]
LatentIndex = Annotated[int, Field(ge=0, le=(1 << 31) - 1, description="a latent of the SAE, in [0, d_sae)")]


class FeaturesRequest(PromptRequest):
    """Each token's strongest latents (:func:`attnlab.interpret.sae_view.strongest_latents`)."""

    sae: SAEIndex = 0
    n: int = Field(default=8, ge=1, le=64, description="latents per token")


class LatentRequest(PromptRequest):
    """One latent's activation on each token of the prompt and its dashboard
    (:func:`attnlab.interpret.sae_view.dashboard_data`)."""

    sae: SAEIndex = 0
    latent: LatentIndex
    over: Literal["prompt", "corpus"] = Field(
        default="prompt", description="the dashboard's tokens: the prompt's, or the corpus given at start-up"
    )
    top_k: int = Field(default=5, ge=1, le=50, description="top-activating contexts shown")
    window: int = Field(default=8, ge=0, le=64, description="tokens each side of a context's peak")
    n_logits: int = Field(default=10, ge=1, le=50, description="promoted and suppressed tokens shown")


class SteerLatent(Strict):
    latent: LatentIndex
    strength: float = Field(
        ge=-1e6, le=1e6, allow_inf_nan=False, description="the multiple of the latent's decoder direction added"
    )


class SteerRequest(PromptRequest):
    """A generation steered by latents (:func:`attnlab.interpret.steer`), and the same one unsteered."""

    sae: SAEIndex = 0
    steer: list[SteerLatent] = Field(min_length=1, max_length=16, description="latents and their strengths")
    max_new_tokens: NewTokens = 16
    temperature: Temperature = 0.0
    top_k: TopK = None
    top_p: TopP = None
    seed: Seed = 0
    compare: bool = Field(default=True, description="also generate without steering (the same seed)")
