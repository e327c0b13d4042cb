"""The files that real models come in, read into (and written from) attnlab's :class:`~attnlab.GPT`.

One module per format or family of weight layouts; each holds layouts and configuration mappings
only, and :class:`attnlab.GPT` builds itself from what they return, so the model imports this
package and never the other way round:

- :mod:`attnlab.formats.families`: the one table of weight names (GPT-2, Llama, Mistral, Qwen2/2.5,
  Qwen3, Gemma, Gemma 2, Gemma 3 text, Phi-3, OLMo 2, GPT-NeoX/Pythia: a row each, Hugging Face's
  names and llama.cpp's), and the dispatch by ``model_type``.
- :mod:`attnlab.formats.hf`: Hugging Face GPT-2 (a bare state dict's config read from its tensors).
- :mod:`attnlab.formats.hf_llama`: Hugging Face Llama-family weights (Llama, Mistral).
- :mod:`attnlab.formats.hub`: Hugging Face model directories and the Hub download.
- :mod:`attnlab.formats.gguf`: GGUF files (llama.cpp, Ollama, LM Studio), read through the table.
- :mod:`attnlab.formats.chat`: chat templates (Jinja, rendered in a sandbox as transformers does).
"""
