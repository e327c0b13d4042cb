"""The tutorials' own classes, kept as they were written (bugs included), for comparison.

attnlab's tests, benchmarks and ``attnlab explain`` measure attnlab against these: they are the
"tutorial path" (explicit scores, masks and softmax, materialising every ``(T, T)`` matrix). Do not
use them to build models; use :mod:`attnlab.attention`. Each class names the tutorial it comes from;
where the code is wrong, the docstring says how (``attnlab explain`` shows the right result).
"""

from __future__ import annotations

import torch
import torch.nn as nn

# "Your journey starts with one step": the six 3-d embeddings of "A simple self-attention mechanism".
INPUTS = torch.tensor(
    [
        [0.43, 0.15, 0.89],  # Your (x^1)
        [0.55, 0.87, 0.66],  # journey (x^2)
        [0.57, 0.85, 0.64],  # starts (x^3)
        [0.22, 0.58, 0.33],  # with (x^4)
        [0.77, 0.25, 0.10],  # one (x^5)
        [0.05, 0.80, 0.55],  # step (x^6)
    ]
)
WORDS = ["Your", "journey", "starts", "with", "one", "step"]


# ---------------------------------------------------------------- "A simple self-attention mechanism"
class SelfAttention_v1(nn.Module):
    """From "A simple self-attention mechanism". 2-D inputs only (uses ``keys.T``)."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x):
        keys = x @ self.W_key
        queries = x @ self.W_query
        values = x @ self.W_value
        attn_scores = queries @ keys.T  # omega
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        context_vec = attn_weights @ values
        return context_vec


class SelfAttention_v2(nn.Module):
    """From "A simple self-attention mechanism". 2-D inputs only (uses ``keys.T``)."""

    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.T
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        context_vec = attn_weights @ values
        return context_vec


class CausalAttention(nn.Module):
    """From "A simple self-attention mechanism": stores a persistent ``mask`` buffer."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context_vec = attn_weights @ values
        return context_vec


class MultiHeadAttentionWrapper(nn.Module):
    """From "A simple self-attention mechanism": a stack of ``CausalAttention`` heads."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, d_out, context_length, dropout, qkv_bias) for _ in range(num_heads)]
        )

    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=-1)


class MultiHeadAttention(nn.Module):
    """From "A simple self-attention mechanism": weight splits, explicit ``(T, T)`` scores per head.

    This is the "tutorial path" of the benchmarks: it materialises ``num_heads x T x T`` scores.
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim)
        keys = keys.transpose(1, 2)
        queries = queries.transpose(1, 2)
        values = values.transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context_vec = (attn_weights @ values).transpose(1, 2)
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
        context_vec = self.out_proj(context_vec)
        return context_vec


# ---------------------------------------------------------------- "Implementing GPT-Style Attention"
class GuideSelfAttention(nn.Module):
    """``SelfAttention`` of "Implementing GPT-Style Attention: A Step-by-Step Guide with PyTorch", verbatim.

    Its ``nn.Linear`` layers keep the default ``bias=True``. 2-D inputs only (uses ``keys.T``).
    """

    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out)
        self.W_key = nn.Linear(d_in, d_out)
        self.W_value = nn.Linear(d_in, d_out)

    def forward(self, x):
        queries = self.W_query(x)
        keys = self.W_key(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.T
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        context_vecs = attn_weights @ values
        return context_vecs


class GuideCausalAttention(nn.Module):
    """``CausalAttention`` of the GPT-style guide, verbatim.

    It creates ``W_keys`` (with an s) *before* ``W_query``, and its ``dropout`` defaults to 0.1.
    """

    def __init__(self, d_in, d_out, context_length, dropout=0.1, qkv_bias=False):
        super().__init__()
        self.W_keys = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self.W_keys(x)
        query = self.W_query(x)
        values = self.W_value(x)
        att_scores = query @ keys.transpose(1, 2)
        att_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(att_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context_vec = attn_weights @ values
        return context_vec


class GuideMultiHeadAttention(nn.Module):
    """``MultiHeadAttention`` of the GPT-style guide, verbatim: ``num_heads`` third, biased
    projections (``nn.Linear``'s default), no default for ``dropout``."""

    def __init__(self, d_in, d_out, num_heads, context_length, dropout):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_in = d_in
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out)
        self.W_key = nn.Linear(d_in, d_out)
        self.W_value = nn.Linear(d_in, d_out)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        batch_size, num_tokens, d_in = x.shape
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        keys = keys.view(batch_size, num_tokens, self.num_heads, self.head_dim)
        queries = queries.view(batch_size, num_tokens, self.num_heads, self.head_dim)
        values = values.view(batch_size, num_tokens, self.num_heads, self.head_dim)
        keys = keys.transpose(1, 2)
        queries = queries.transpose(1, 2)
        values = values.transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context_vec = attn_weights @ values
        context_vec = context_vec.transpose(1, 2)
        context_vec = context_vec.contiguous().view(batch_size, num_tokens, -1)
        context_vec = self.out_proj(context_vec)
        return context_vec


# ---------------------------------------------------------------- the attention-review exercises
class SelfAttentionV2(nn.Module):
    """``SelfAttentionV2`` of the attention-review exercises ("Attention Review", In [2]), verbatim.

    Its ``nn.Linear`` layers keep the default ``bias=True``; batched inputs ``(B, N, d_in)`` only.
    """

    def __init__(self, d_in, d_out):
        super().__init__()
        self.d_in = d_in
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out)
        self.W_key = nn.Linear(d_in, d_out)
        self.W_value = nn.Linear(d_in, d_out)

    def forward(self, x):
        Q = self.W_query(x)
        K = self.W_key(x)
        V = self.W_value(x)
        QKT = Q @ K.transpose(1, 2)
        A = torch.softmax(QKT / (self.d_out**0.5), dim=-1)
        context_vector = A @ V
        return context_vector


class CausalAttentionReview(nn.Module):
    """``CausalAttention`` of the attention-review exercises (Exercise 3), verbatim.

    Bugs: it scales by ``d_out`` read from the *global* scope (not ``self.d_out``), and its
    ``tril`` mask is not sliced, so inputs shorter than ``context_length`` fail.
    """

    def __init__(self, d_in, d_out, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.d_in = d_in
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.context_length = context_length
        causal_mask = torch.tril(torch.ones(context_length, context_length))
        self.register_buffer("mask", causal_mask)

    def forward(self, x, d_out=None):
        # The exercise reads a global `d_out`; passing it explicitly reproduces that behaviour.
        d_out = self.d_out if d_out is None else d_out
        B, N, D = x.shape
        Q = self.W_query(x)
        K = self.W_key(x)
        V = self.W_value(x)
        attention_scores = Q @ K.transpose(1, 2)
        attention_scores = attention_scores.masked_fill(self.mask == 0, float("-inf"))
        attention_probs = torch.softmax(attention_scores / (d_out**0.5), dim=-1)
        attention_probs = self.dropout(attention_probs)
        return attention_probs @ V


class MultiHeadAttentionReview(nn.Module):
    """``MultiHeadAttention`` of the attention-review exercises (Exercise 5), verbatim.

    A wrapper: ``num_heads`` exercise ``CausalAttention`` heads of width ``d_out // num_heads``,
    concatenated, with *no* output projection (attnlab's ``MultiHeadAttention`` has one). Its
    heads scale by the global ``d_out`` (see :class:`CausalAttentionReview`): ``forward(x, d_out=100)``
    reproduces the notebook, where that global is still 100 from Exercise 2.
    """

    def __init__(self, d_in, d_out, num_heads, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.d_in = d_in
        self.d_out = d_out
        self.num_heads = num_heads
        self.d_head = d_out // num_heads
        self.heads = nn.ModuleList(
            [
                CausalAttentionReview(
                    d_in=d_in, d_out=self.d_head, context_length=context_length, dropout=dropout, qkv_bias=qkv_bias
                )
                for _ in range(num_heads)
            ]
        )

    def forward(self, x, d_out=None):
        return torch.cat([head(x, d_out=d_out) for head in self.heads], dim=-1)


class MultiHeadAttentionOneModule(nn.Module):
    """``MultiHeadAttentionOneModule`` of the attention-review exercises (Exercise 6), verbatim.

    Its output layer is called ``projection`` (``out_proj`` in the other tutorials) and its mask is
    not sliced, so the input must be exactly ``context_length`` tokens long.
    """

    def __init__(self, d_in, d_out, num_heads, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_in = d_in
        self.d_out = d_out
        self.num_heads = num_heads
        self.d_head = d_out // num_heads
        self.context_length = context_length
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        causal_mask = torch.tril(torch.ones(context_length, context_length))
        self.projection = nn.Linear(d_out, d_out)
        self.register_buffer("mask", causal_mask)

    def forward(self, x):
        B, N, D = x.shape
        Q = self.W_query(x)
        K = self.W_key(x)
        V = self.W_value(x)
        Q = Q.view(B, N, self.num_heads, self.d_head).transpose(1, 2)
        K = K.view(B, N, self.num_heads, self.d_head).transpose(1, 2)
        V = V.view(B, N, self.num_heads, self.d_head).transpose(1, 2)
        QKT = Q @ K.transpose(2, 3)
        masked_QKT = QKT.masked_fill(self.mask == 0, float("-inf"))
        attention_probs = torch.softmax(masked_QKT / (self.d_head**0.5), dim=-1)
        attention_probs = self.dropout(attention_probs)
        context_vector = attention_probs @ V
        context_vector = context_vector.transpose(1, 2).contiguous().view(B, N, self.d_out)
        return self.projection(context_vector)


class BadLM_V2(nn.Module):
    """``BadLM_V2`` of the attention-review exercises, verbatim.

    Bug: the position embedding is sized by ``vocab_size`` instead of ``context_length`` (50257 x
    768 position vectors where ``context_length`` are used), and ``forward`` adds
    ``pos_embs(arange(context_length))``, so any input shorter than ``context_length`` fails.
    """

    def __init__(self, context_length, vocab_size, emb_dim, att_dim, num_heads):
        super().__init__()
        self.context_length = context_length
        self.emb_dim = emb_dim
        self.att_dim = att_dim
        self.num_heads = num_heads
        self.vocab_size = vocab_size
        self.token_embs = nn.Embedding(vocab_size, emb_dim)
        self.pos_embs = nn.Embedding(vocab_size, emb_dim)
        self.att = MultiHeadAttentionOneModule(emb_dim, att_dim, num_heads, context_length)
        self.prediction_layer = nn.Linear(att_dim, vocab_size)

    def forward(self, x):
        embedding = self.token_embs(x) + self.pos_embs(torch.arange(self.context_length))
        context_embedding = self.att(embedding)
        return self.prediction_layer(context_embedding)
