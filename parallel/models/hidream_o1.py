"""HiDream-O1-Image (ComfyUI 0.33's `HiDreamO1Transformer`, comfy/ldm/hidream_o1/model.py): what is split.

One Qwen3-VL decoder (`language_model.layers`) runs over one stream [input_ids (text, ending in the `tms` token whose
embedding is the timestep's), target image patches (+ reference patches)], embedded as `embed_tokens(input_ids)`
joined with `x_embedder(patches)`. Its attention is two-pass (attention.py): the first `ar_len` tokens (the text
before `tms`) attend causally among themselves only, through SDPA directly; the rest [tms, image] attend every key,
through ComfyUI's `optimized_attention`. So the AR prefix never reads an image token: every rank computes it whole
and the same, and only the image tokens are split:

* the split is at `x_embedder`'s output (the image patches' embeddings; a per-token Linear stack), so the model's
  own `cat([text embeds, image embeds])` builds [text, this rank's image shard];
* each decoder layer's RoPE table (`freqs_cis`: cos, sin, -sin over the whole stream's MRoPE positions) keeps its
  text prefix and takes this rank's image rows (`after_prefix`: the prefix is what it holds beyond the image);
  the KV-cache path's table, cut by the model to [tms, image], is read the same way (a prefix of one);
* the generated tokens' pass is the joint attention, declared on `self_attn` through ComfyUI's seam: its queries
  are [tms, local image], its keys [AR prefix, tms, local image] - the AR prefix being keys only there, so the
  declaration says `query_tail` (the seam fills the prefix's query rows with zeros and drops their output rows).
  The replicated text prefix is the whole text ([AR, tms]); Qwen3-VL's grouped K/V heads (32 q / 8 kv) are expanded
  by the seam (`enable_gqa`). The causal pass calls torch's SDPA directly, outside the seam: it stays local;
* the final norm (per token) is gathered behind one copy of the text (`GatherOutput(after_prefix)`), so the model's
  `vinput_mask` / `input_ids`-length cut and `final_layer2` read the whole stream as without the split.

The AR K/V cache (steps after the first reuse the prefix's K/V, and feed [tms, image] only) holds the prefix's rows,
the same on every rank, and is keyed by the whole `input_ids` - each rank's cache is the single-process one.

Edit / reference images (`ref_patches` joining the split stream, `ref_pixel_values` through the vision tower) are
refused under ulysses/ring: the layout would carry them (the target's cut after the gather takes its rows first),
but it was not checked against KSampler; cfg/dp split the batch only and run them as ComfyUI does.
"""
from .adapter import FamilyAdapter
from ..plan import Attention, FamilyPlan, GatherOutput, SplitInput, SplitOutput

_REFS = ("edit / reference images (HiDream-O1 Reference Images) join the split image stream and the vision tower's "
         "tokens; the sequence split was not checked with them - use cfg/dp degrees (ulysses/ring degree 1) with "
         "reference images")

COMFY_PLAN = FamilyPlan(
    family="hidream_o1",
    model_class="HiDreamO1Transformer",
    batch_inputs=("x", "timesteps", "context", "input_ids", "position_ids", "token_types", "vinput_mask",
                  "attention_mask"),
    sequence={
        "x_embedder": [SplitOutput(dim=1)],
        "language_model.layers.*": [SplitInput("freqs_cis", dim=1, item=i, after_prefix=True) for i in range(3)],
        "language_model.norm": [GatherOutput(dim=1, after_prefix=True)],
    },
    attention={"language_model.layers.*.self_attn": Attention(text_first=True, seam="comfy", query_tail=True)},
    heads_attr="num_heads",
    tp_refusal="tensor parallel is not declared for HiDream-O1; use ulysses/ring/cfg degrees",
    pipeline_refusal="PipeFusion on HiDream-O1 is not implemented; use ulysses/ring/cfg degrees",
    # every step synchronous it is exact (1.8e-6), but one stale step of two was 2.6e-1 from KSampler on the tiny
    # model (other families 1e-4 to 1e-2): not understood yet, so not offered
    distrifusion_refusal="its stale steps are not understood yet (one stale step measured 2.6e-1 from KSampler); use "
                         "method usp",
    sequence_refusals={"ref_patches": _REFS, "ref_pixel_values": _REFS, "ref_image_grid_thw": _REFS},
    comfy=True,
)

ADAPTER = FamilyAdapter(family="hidream_o1", title="HiDream-O1", comfy_plan=COMFY_PLAN,
                        comfy_module="comfy.ldm.hidream_o1.model")
