"""LoRA files for the Wan DiT: read (safetensors only), map onto the model's layers, merge into the weights.

Key formats (the ones diffusers' Wan LoRA loader reads):

* diffusers / PEFT: ``[transformer.]blocks.N.attn1.to_q.lora_A.weight`` and ``lora_B.weight`` under the
  model's own module names, optionally ``<module>.alpha`` and a bias ``lora_B.bias`` (PEFT's ``lora_bias``); PEFT's
  in-memory names with the adapter's (``lora_A.default.weight``), and diffusers' older spellings
  (``lora.down`` / ``lora.up``, attention-processor keys ``attn1.processor.to_q_lora.down.weight``, a DoRA's
  ``attn1.to_out.lora_magnitude_vector`` for ``to_out.0``);
* the original Wan / ComfyUI / lightx2v layout: ``diffusion_model.blocks.N.self_attn.q.lora_down.weight`` /
  ``lora_up.weight`` (or ``lora_A`` / ``lora_B``), ``<module>.alpha``, full deltas ``<module>.diff`` and bias
  deltas ``<module>.diff_b``, under the original module names (:data:`fastwan.lora.keys.WAN_NAMES` maps them);
* kohya / musubi-tuner: ``lora_unet_blocks_N_self_attn_q.lora_down.weight`` (the same parts): ``lora_unet_`` and
  the original module name with each dot written as an underscore (:func:`fastwan.lora.keys.kohya_name` reads it back).

A module's update is ``W += scale * (alpha / rank) * B @ A``, ``W += scale * diff``,
``b += scale * diff_b`` and ``b += scale * (alpha / rank) * lora_B.bias`` (PEFT scales its bias as its product),
computed in fp32 and rounded once into the weight's dtype; an FP8 layer's weight is
dequantized, updated in fp32 and quantized again (new per-channel scales). Any finite scale merges, as diffusers'
adapter weights do: 0 changes no tensor, a negative one subtracts the update. The update is computed on the
generator's device, wherever a memory plan keeps the weight, so a plan changes no merged bit. Merged weights cost
nothing at run time; :class:`LoraState` keeps each changed tensor's original (on the CPU) so unloading restores it
bit for bit.

Refused before any weight changes (a user error naming the key, the rule and the fix): files that hold no tensors,
LoRA tensors that are not floating point or hold NaN / inf, a rank of 0, an alpha that is not one finite number,
shapes that do not fit, and a scale whose merged weight (or bias) would leave its dtype's range. Safetensors only;
pickle files (by name) with ``allow_pickle=True``, read weights-only. One file given twice for one DiT in
``from_pretrained(lora=...)`` (or ``--lora``) is refused (:func:`fastwan.lora.merge.check_repeats`).
The layers are the linear ones and the convolutions (the patch embedding: there ``A`` holds the kernel,
``[rank, in, *kernel]``, and ``B`` is ``[out, rank, 1, ...]``, as PEFT trains one). Deltas of norms (zeros in the
files that carry them; under diffusers' names or the original ones: ``self_attn.norm_q``, ``cross_attn.norm_k_img``,
``norm3``, ``head.norm``, ``img_emb.proj.0``) and of the parameters outside the layers (lightx2v's modulation deltas
``blocks.N.diff_m`` / ``head.diff_m``, ``modulation.diff``) are skipped, as diffusers skips them; non-zero ones are
named in a warning. Where diffusers drops a delta of a layer it cannot express as a PEFT LoRA (full-weight ``diff``
keys, a ``time_projection`` ``diff_b`` without its weights), fastwan merges it as written. Tensors stored in FP8
are read as the bf16 values they hold (exactly).

A module's alpha is its ``<module>.alpha`` tensor; else, for ``lora_A`` / ``lora_B`` keys, the LoraConfig that
diffusers / PEFT save in the file's safetensors metadata (``lora_adapter_metadata``: ``lora_alpha``, its
``alpha_pattern``, ``use_rslora`` for ``alpha / sqrt(rank)``; the ``transformer.``-prefixed entries of a pipeline
save, or the unprefixed ones of a model save), as diffusers' ``load_lora_weights`` reads it; else the rank.
Each module takes its update from one set of keys: two keys giving one module the same part (two formats or two
names in one file) are an error, and so are other adapter kinds (LyCORIS LoHa / LoKr / Tucker, kohya's DoRA
``dora_scale``, which diffusers refuses or drops), whose updates are not ``B @ A``.

A PEFT DoRA's magnitude ``<module>.lora_magnitude_vector`` (``.weight`` or ``.<adapter>.weight`` may follow; one
value per output feature: ``[out]``, a convolution's ``[1, out, 1, ...]``) merges as PEFT merges it: with
``D = scale * (alpha / rank) * B @ A``, ``W <- m / ||W0 + D|| * (W + D)``, the norm per output feature, ``W0`` the
weight before any LoRA merged (PEFT's norm leaves out the adapters merged before). A file whose metadata's
``use_dora`` contradicts its tensors (diffusers would make up or drop the magnitudes) is refused.

Modules: :mod:`.keys` (key spellings -> the model's module names and parts), :mod:`.files` (reading a file and
its metadata's alphas), :mod:`.merge` (shape checks, the merge and its undo, the public entry points).
"""
from fastwan.lora.files import read_lora
from fastwan.lora.merge import LoraState, apply_lora, check_loras, lora_updates, parse_lora_spec

__all__ = ["LoraState", "apply_lora", "check_loras", "lora_updates", "parse_lora_spec", "read_lora"]
