"""Each tutorial's own classes, exactly: its argument order, its defaults, its parameter creation
order (so the tutorial's ``torch.manual_seed`` calls give its numbers), on attnlab's fused core.

attnlab's main classes (:mod:`attnlab.attention`) follow "A simple self-attention mechanism". The
other tutorials write classes of the same names with other argument orders, other defaults,
biases, or parameters created in another order; code from them builds a different model on
attnlab's classes, or the same model with other random weights. These modules give each
tutorial's variant:

=========================================================================  ==========================================
tutorial                                                                   module
=========================================================================  ==========================================
"A simple self-attention mechanism"                                        :mod:`attnlab.tutorials.simple`
"Implement the Self-Attention Mechanism in PyTorch"                        :mod:`attnlab.tutorials.implement`
"Implementing GPT-Style Attention: A Step-by-Step Guide with PyTorch"      :mod:`attnlab.tutorials.gpt_style`
the attention-review exercises ("Concept Questions" / "Attention Review")  :mod:`attnlab.tutorials.attention_review`
"Self attention for a single individual head"                              :mod:`attnlab.tutorials.one_head`
=========================================================================  ==========================================

Which attnlab class matches which tutorial's class, seed for seed (the tests check each pair
against the tutorial's code, kept verbatim in :mod:`attnlab.tutorial_code`):

* "A simple self-attention mechanism": ``SelfAttention_v1``, ``SelfAttention_v2``,
  ``CausalAttention``, ``MultiHeadAttentionWrapper``, ``MultiHeadAttention`` of
  :mod:`attnlab.attention` are its classes (:mod:`attnlab.tutorials.simple` re-exports them).
* "Implement the Self-Attention Mechanism in PyTorch" has no classes, and its separate query, key
  and value widths (24/24/28) and ``(d, d_in)`` ``torch.rand`` weights fit none of attnlab's:
  :class:`attnlab.tutorials.implement.SelfAttention` and
  :class:`~attnlab.tutorials.implement.MultiHeadSelfAttention`.
* The GPT-style guide: its ``SelfAttention`` and ``MultiHeadAttention`` have biased projections
  (attnlab: ``qkv_bias=True``) and ``MultiHeadAttention`` puts ``num_heads`` third; its
  ``CausalAttention`` creates ``W_keys`` before ``W_query`` and defaults to ``dropout=0.1``, so no
  attnlab class gives its numbers: :mod:`attnlab.tutorials.gpt_style`.
* The attention-review exercises: ``SelfAttentionV2`` is biased; ``CausalAttention`` is
  attnlab's (same order and defaults; the exercise's mask and scale bugs fixed);
  Exercise 5's ``MultiHeadAttention`` is a wrapper of heads of width ``d_out // num_heads`` with no
  output projection, i.e. ``MultiHeadAttentionWrapper(d_in, d_out // num_heads, ...)``, not
  attnlab's ``MultiHeadAttention``; ``MultiHeadAttentionOneModule`` is attnlab's
  ``MultiHeadAttention`` with ``num_heads`` third: :mod:`attnlab.tutorials.attention_review`.
* "Self attention for a single individual head" creates key, query, value in that order
  (attnlab: query, key, value) without biases: :class:`attnlab.tutorials.one_head.Head`.

Import a tutorial's module and use its names as the tutorial does::

    from attnlab.tutorials.gpt_style import CausalAttention, MultiHeadAttention
    mha = MultiHeadAttention(d_in, d_out, num_heads, context_length, 0.0)   # the guide's order
"""

# The modules are imported by name (attnlab.tutorials.gpt_style, ...); nothing is re-exported here,
# because the tutorials' classes share names and differ.
__all__: list[str] = []
