"""EAGLE-3 drafter: one decoder layer over three of the target's layers.

EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
via Training-Time Test", arXiv 2503.01840) as implemented by SafeAILab/EAGLE
(``eagle/model/cnets.py``, ``eagle/traineagle3/cnets.py``), vLLM (``llama_eagle3.py``) and
SGLang (``llama_eagle3.py``):

- **Inputs.** For every committed position ``t`` the target's residual stream entering three
  layers (capture-before-layer convention, ``aux_layers``, default ``(2, N // 2, N - 3)`` for
  an N-layer target), concatenated in ascending order: a ``[3 * Ht]`` row, exactly what
  `target_worker.model.Decoder.set_capture_layers` returns. ``fc`` ``[3Ht -> H]`` (no bias)
  fuses it once; later draft steps feed back the head's own **pre-norm** output (H wide, fc
  skipped).
- **The layer** (``midlayer``): ``x = cat(input_layernorm(embed(x_{t+1})),
  hidden_norm(h))`` (2H, embedding first) -> q/k/v, grouped-query attention with RoPE at the
  target's absolute position ``t`` (the head's own ``rope_theta``), o_proj, plus the residual
  ``h`` (un-normed; the normed ``hidden_norm(h)`` with ``norm_before_residual``, as vLLM's
  ``llama_eagle3`` and speculators do), then ``post_attention_layernorm`` -> SwiGLU MLP ->
  plus residual. That sum is the pre-norm output fed back.
- **The head**: ``lm_head(norm(h))`` over a draft vocabulary of ``Vd`` target tokens; draft
  id ``i`` is target id ``i + d2t[i]`` (``d2t``: int64 offsets; ``t2d``: bool ``[V]``
  membership mask). Embeddings: the head's own ``embed_tokens`` if the checkpoint has one,
  else the target's (frozen, shared).

**Layer ids.** One convention inside: capture-before (HF ``hidden_states[i]``: ``i`` is the
input of decoder layer ``i``, ``N`` the last layer's output before the final norm), the
convention of EAGLE's reference code, of vLLM, and of speculators' ids as vLLM reads them
(verbatim). EAGLE and SpecForge configs normally carry no ids: the default for the target's
layer count applies. Ids a SpecForge config carries (``eagle_config.
eagle_aux_hidden_state_layer_ids``) are SGLang's "output of layer X" and are converted to
``X + 1`` on load (SGLang adds the 1 itself). Ids must be strictly ascending: the target
returns its captured layers in ascending order and ``fc``'s columns follow the ids' order.

Checkpoint layouts loaded (`load_eagle3`): (a) EAGLE repository checkpoints (an HF
LlamaConfig-style ``config.json`` with ``draft_vocab_size``; tensors ``midlayer.*``, ``fc``,
``norm``, ``lm_head``, ``d2t``, ``t2d``, optional ``embed_tokens``), (b) Red Hat
speculators (``speculators_config``, ``transformer_layer_config``, tensors ``layers.0.*``;
``norm_before_fc``'s ``input_norm`` supported, ``fc_norm`` and ``norm_output`` refused), (c)
SpecForge exports (``LlamaForCausalLMEagle3``, no embeddings). Weights: ``model.safetensors``
(or a sharded index) or ``pytorch_model.bin`` read with ``torch.load(weights_only=True)``:
a checkpoint never runs code. `Eagle3Head.save` writes the speculators layout, so a head
specd ships loads by the same loader.

Drafting (`Eagle3Session`) mirrors `drafter_worker.eagle.EagleSession`: a KV cache over the
committed positions, rolled back after every proposal; drafts are the head's argmax at every
temperature, reported as point masses (vLLM drafts EAGLE's argmax too), so the rule couples
each position to plain sampling and a seeded request's tokens are the same drafted or not
(`specd_core.rule`); dynamic draft length by the head's own confidence (EAGLE-2); stop
tokens end a block.

The package: `config` (`Eagle3Config`, a head directory's files, the three layouts'
``config.json``), `head` (the head's modules and `Eagle3Head.save`), `loading`
(`inspect_eagle3`, `load_eagle3`), `drafter` (`Eagle3Session`, `Eagle3Drafter`,
`SuffixThenEagle3`). Each imports only those before it; this module re-exports their public
names.
"""

from .config import RECIPE_FILE, Eagle3Config, check_fits, default_aux_layers
from .drafter import (
    Eagle3Drafter,
    Eagle3Session,
    SuffixThenEagle3,
    default_head_dtype,
    resolve_head_dtype,
)
from .head import Eagle3Head
from .loading import DEFAULT_EAGLE3_HEAD, inspect_eagle3, load_eagle3, resolve_head_dir

__all__ = [
    "DEFAULT_EAGLE3_HEAD",
    "Eagle3Config",
    "Eagle3Drafter",
    "Eagle3Head",
    "Eagle3Session",
    "RECIPE_FILE",
    "SuffixThenEagle3",
    "check_fits",
    "default_aux_layers",
    "default_head_dtype",
    "inspect_eagle3",
    "load_eagle3",
    "resolve_head_dir",
    "resolve_head_dtype",
]

