"""Tiny random-weight LTX-2.3 files, written under the names the bundled LTX-2.3 workflows load.

One checkpoint holds what the real `ltx-2.3-22b-dev-fp8.safetensors` holds: the AV DiT (`model.diffusion_model.`),
the video VAE (`vae.`), the audio VAE (`audio_vae.`), its vocoder (`vocoder.`) and the text projection
(`text_embedding_projection.`), with their sizes in the file metadata `config` (sections `transformer`, `vae`,
`audio_vae`, `vocoder`) as ComfyUI 0.33.0 reads them. The LTX-2.3 switches are on: gated attention,
cross-attention AdaLN, caption projection before the gated connectors (no first linear), two-output text projection;
the video VAE uses the "version 2" block layout. Beside it: a Gemma 3 text encoder (+ sentencepiece tokenizer, ids
pad 0, eos 1, bos 2, unk 3) whose tiny sizes travel in a marker tensor the test shim (tools/tiny_model_loaders)
passes to ComfyUI's per-model config override; the distilled LoRA (rank 4 on the DiT's attention linears) and the
x2 latent upsampler.

Weights: seeded normal with std 1/sqrt(fan_in) (activations stay O(1) through the layers), norm weights 1 except
the attention q/k norms, which are QK_NORM_GAIN so that the scores q.k/sqrt(d) have a standard deviation of about
QK_NORM_GAIN^2 and attention is far from uniform (the end-to-end test must notice a broken attention).

Needs ComfyUI 0.33.0 importable (the LTX-2.3 model code); run as `python -m tools.tiny_models_ltx23 MODELS INPUT`
to write into a ComfyUI base directory from a process that has not imported another ComfyUI.
"""
import json
import math
import os
import sys

import torch

CHECKPOINT = "ltx-2.3-22b-dev-fp8.safetensors"
TEXT_ENCODER = "gemma_3_12B_it_fp4_mixed.safetensors"
LORA = "ltx-2.3-22b-distilled-lora-384.safetensors"
UPSCALER = "ltx-2.3-spatial-upscaler-x2-1.0.safetensors"
INPUT_IMAGE = "example.png"
MARK_GEMMA = "tiny_test.gemma3_config"  # read by tools/tiny_model_loaders
QK_NORM_GAIN = 2.0

# Video and audio streams: 2 heads x 16 = 32 wide; the text projection outputs 32 + 32 (video, audio).
TRANSFORMER = {
    "num_attention_heads": 2, "attention_head_dim": 16, "cross_attention_dim": 32,
    "audio_num_attention_heads": 2, "audio_attention_head_dim": 16, "audio_cross_attention_dim": 32,
    "num_layers": 2, "in_channels": 128, "audio_in_channels": 128, "caption_channels": 32,
    "apply_gated_attention": True, "cross_attention_adaln": True,
    "caption_proj_before_connector": True, "caption_projection_first_linear": False,
    "connector_apply_gated_attention": True, "connector_num_layers": 1,
    "connector_num_attention_heads": 2, "connector_attention_head_dim": 16,
    "audio_connector_num_attention_heads": 2, "audio_connector_attention_head_dim": 16,
}
VIDEO_VAE = {  # the "version 2" block layout (compress_*_res encoder, residual compress_all decoder), 1 layer each
    "_class_name": "CausalVideoAutoencoder", "dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128,
    "encoder_base_channels": 8, "decoder_base_channels": 8,
    "encoder_blocks": [["res_x", {"num_layers": 1}], ["compress_space_res", {"multiplier": 2}],
                       ["res_x", {"num_layers": 1}], ["compress_time_res", {"multiplier": 2}],
                       ["compress_all_res", {"multiplier": 2}], ["compress_all_res", {"multiplier": 2}],
                       ["res_x", {"num_layers": 1}]],
    "decoder_blocks": [["res_x", {"num_layers": 1, "inject_noise": False}],
                       ["compress_all", {"residual": True, "multiplier": 2}],
                       ["res_x", {"num_layers": 1, "inject_noise": False}],
                       ["compress_all", {"residual": True, "multiplier": 2}],
                       ["res_x", {"num_layers": 1, "inject_noise": False}],
                       ["compress_all", {"residual": True, "multiplier": 2}],
                       ["res_x", {"num_layers": 1, "inject_noise": False}]],
    "scaling_factor": 1.0, "norm_layer": "pixel_norm", "patch_size": 4, "latent_log_var": "uniform",
    "use_quant_conv": False, "causal_decoder": False, "timestep_conditioning": True,
}
AUDIO_VAE = {  # 64 mel bins, 8 latent channels -> 16 frequency bins x 8 = the DiT's 128 audio channels
    "model": {"params": {"sampling_rate": 16000, "ddconfig": {
        "double_z": True, "mel_bins": 64, "z_channels": 8, "resolution": 256, "downsample_time": False,
        "in_channels": 2, "out_ch": 2, "ch": 8, "ch_mult": [1, 2, 4], "num_res_blocks": 1, "attn_resolutions": [],
        "dropout": 0.0, "mid_block_add_attention": False, "norm_type": "pixel", "causality_axis": "height"}}},
    "preprocessing": {"stft": {"hop_length": 160, "filter_length": 1024}},
}
VOCODER = {"resblock_kernel_sizes": [3], "upsample_rates": [4, 4, 10], "upsample_kernel_sizes": [8, 8, 20],
           "resblock_dilation_sizes": [[1, 3, 5]], "upsample_initial_channel": 16, "stereo": True,
           "activation": "snake", "resblock": "1"}
# Gemma 3 12B at tiny sizes (head_dim stays 256: a class constant). Its vision tower (a class constant too, built
# but unused by these workflows) is shrunk to GEMMA_VISION while the shim loads the file.
GEMMA = {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 1, "num_key_value_heads": 1}
GEMMA_VISION = {"num_channels": 3, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 16, "image_size": 64,
                "intermediate_size": 32, "model_type": "siglip_vision_model", "num_attention_heads": 2,
                "num_hidden_layers": 1, "patch_size": 4}  # 64 / 4 = 16 patches a side: Gemma pools to 16 x 16
UPSAMPLER = {"_class_name": "LatentUpsampler", "in_channels": 128, "mid_channels": 32, "num_blocks_per_stage": 1,
             "dims": 3, "spatial_upsample": True, "temporal_upsample": False, "spatial_scale": 2.0,
             "rational_resampler": False}
LORA_RANK = 4


def fill(sd, seed):
    """Seeded weights: std 1/sqrt(fan_in) for matrices and kernels, 0.02 for biases and other vectors, norms 1,
    q/k norms QK_NORM_GAIN, VAE statistics mean 0 / std 1, AdaLN tables std 0.5 (gates well away from 0)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sd.items():
        if not v.is_floating_point():
            out[k] = v.clone()
            continue
        name = k.rsplit(".", 1)[-1]
        if "std-of-means" in k or "std_of_means" in k:
            t = torch.ones(v.shape)
        elif "mean-of-means" in k or "mean_of_means" in k:
            t = torch.zeros(v.shape)
        elif k.endswith(("q_norm.weight", "k_norm.weight")):
            t = torch.full(v.shape, QK_NORM_GAIN)
        elif v.ndim == 1 and ("norm" in k or name in ("gamma", "scale")) and "bias" not in name:
            t = torch.ones(v.shape)
        elif "scale_shift_table" in k:
            t = torch.randn(v.shape, generator=g) * 0.5
        elif v.ndim >= 2 and name != "learnable_registers":
            t = torch.randn(v.shape, generator=g) / math.sqrt(max(1, v[0].numel()))
        elif name == "learnable_registers":
            t = torch.randn(v.shape, generator=g)
        else:
            t = torch.randn(v.shape, generator=g) * 0.02
        out[k] = t.to(v.dtype).contiguous()
    return out


def _prefixed(prefix, sd):
    return {prefix + k: v for k, v in sd.items()}


def _marker(obj):
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).clone()


def dit_state_dict(seed=1):
    import comfy.ldm.lightricks.av_model as av
    import comfy.ops
    m = av.LTXAVModel(**TRANSFORMER, operations=comfy.ops.disable_weight_init, device="cpu", dtype=torch.float32)
    return fill(m.state_dict(), seed)


def video_vae_state_dict(seed=2):
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE
    return fill(VideoVAE(version=2, config=VIDEO_VAE).state_dict(), seed)


def audio_vae_state_dict(seed=3):
    """`autoencoder.*` and `vocoder.*` of ComfyUI's AudioVAE (stored in the checkpoint as audio_vae.* / vocoder.*)."""
    from comfy.ldm.lightricks.vae.audio_vae import AudioVAE
    m = AudioVAE(metadata={"config": json.dumps({"audio_vae": AUDIO_VAE, "vocoder": VOCODER})})
    return fill(m.state_dict(), seed)


def text_projection_state_dict(seed=4):
    """The two-output (video, audio) projection of Gemma's stacked hidden states (all layers + embeddings)."""
    g = torch.Generator().manual_seed(seed)
    fan_in = GEMMA["hidden_size"] * (GEMMA["num_hidden_layers"] + 1)
    out = {}
    for part in ("video", "audio"):
        dim = TRANSFORMER["cross_attention_dim" if part == "video" else "audio_cross_attention_dim"]
        key = f"text_embedding_projection.{part}_aggregate_embed."
        out[key + "weight"] = torch.randn(dim, fan_in, generator=g) / math.sqrt(fan_in)
        out[key + "bias"] = torch.randn(dim, generator=g) * 0.02
    return out


def checkpoint_state_dict():
    audio = audio_vae_state_dict()
    sd = _prefixed("model.diffusion_model.", dit_state_dict())
    sd.update(_prefixed("vae.", video_vae_state_dict()))
    sd.update({("audio_vae." + k[len("autoencoder."):]) if k.startswith("autoencoder.") else k: v
               for k, v in audio.items()})
    sd.update(text_projection_state_dict())
    return sd


def checkpoint_metadata():
    return {"config": json.dumps({"transformer": TRANSFORMER, "vae": VIDEO_VAE, "audio_vae": AUDIO_VAE,
                                  "vocoder": VOCODER})}


def gemma_tokenizer(vocab_size=GEMMA["vocab_size"]) -> bytes:
    """A sentencepiece model with Gemma's special ids (pad 0, eos 1, bos 2, unk 3)."""
    import io

    import sentencepiece as spm
    text = ["A lighthouse keeper in a yellow raincoat climbs the spiral iron stairs of an old lighthouse",
            "blurry, low quality, still frame, frames, watermark, overlay, titles, has blurbox, has subtitles",
            "The scene in the image comes to life. The main subject moves naturally: a slow turn of the head",
            "rain lashes the windows, the great lamp turns slowly above him and sweeps beams of light",
            "the quick brown fox jumps over the lazy dog 0123456789"] * 20
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=buf, vocab_size=vocab_size,
                                   model_type="unigram", pad_id=0, eos_id=1, bos_id=2, unk_id=3,
                                   hard_vocab_limit=False, num_threads=1, minloglevel=2, character_coverage=1.0,
                                   byte_fallback=True)
    return buf.getvalue()


def gemma_state_dict(seed=5):
    """Gemma 3 12B's architecture at GEMMA sizes, plus the two keys ComfyUI's detection reads (layer 47's q norm
    and layer 5's v_proj: without v_proj it would be Gemma 4 12B); the shim drops them before loading."""
    import comfy.ops
    import comfy.text_encoders.llama as llama
    real = llama.Gemma3_12B_Config.vision_config
    llama.Gemma3_12B_Config.vision_config = GEMMA_VISION
    try:
        m = llama.Gemma3_12B(dict(GEMMA), torch.float32, "cpu", comfy.ops.manual_cast)
    finally:
        llama.Gemma3_12B_Config.vision_config = real
    sd = fill(m.state_dict(), seed)
    sd = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}
    sd["model.layers.47.self_attn.q_norm.weight"] = torch.ones(256, dtype=torch.bfloat16)
    sd.setdefault("model.layers.5.self_attn.v_proj.weight", torch.zeros(1, 1, dtype=torch.bfloat16))
    sd["spiece_model"] = torch.frombuffer(bytearray(gemma_tokenizer()), dtype=torch.uint8).clone()
    sd[MARK_GEMMA] = _marker({"config": GEMMA, "vision_config": GEMMA_VISION})
    return sd


def lora_state_dict(seed=6):
    """Rank-LORA_RANK A/B pairs on every attention linear of the DiT's blocks (ComfyUI's diffusers key form)."""
    g = torch.Generator().manual_seed(seed)
    dit = dit_state_dict()
    out = {}
    for k, v in dit.items():
        if k.startswith("transformer_blocks.") and "attn" in k and k.endswith(("to_q.weight", "to_k.weight",
                                                                               "to_v.weight", "to_out.0.weight")):
            base = "diffusion_model." + k[:-len(".weight")]
            out[base + ".lora_A.weight"] = torch.randn(LORA_RANK, v.shape[1], generator=g) / math.sqrt(v.shape[1])
            out[base + ".lora_B.weight"] = torch.randn(v.shape[0], LORA_RANK, generator=g) * 0.1
    return {k: v.to(torch.bfloat16) for k, v in out.items()}


def upsampler_state_dict(seed=7):
    import comfy.ops
    from comfy.ldm.lightricks.latent_upsampler import LatentUpsampler
    return fill(LatentUpsampler.from_config(UPSAMPLER, operations=comfy.ops.disable_weight_init).state_dict(), seed)


def write_input_image(path, size=(96, 64)):
    """A smooth colour image with some structure (i2v start frame)."""
    import numpy as np
    from PIL import Image
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([128 + 100 * np.sin(x / 7.0), 128 + 100 * np.cos(y / 5.0), 128 + 90 * np.sin((x + y) / 11.0)], -1)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(img.clip(0, 255).astype("uint8")).save(path)
    return path


def write_ltx23_model_set(models_dir, input_dir):
    """Every file the three bundled LTX-2.3 workflows load, under their names and folders; returns the paths."""
    from safetensors.torch import save_file
    paths = {
        "checkpoint": os.path.join(models_dir, "checkpoints", CHECKPOINT),
        "text_encoder": os.path.join(models_dir, "text_encoders", TEXT_ENCODER),
        "lora": os.path.join(models_dir, "loras", LORA),
        "upscaler": os.path.join(models_dir, "latent_upscale_models", UPSCALER),
    }
    for p in paths.values():
        os.makedirs(os.path.dirname(p), exist_ok=True)
    save_file(checkpoint_state_dict(), paths["checkpoint"], metadata=checkpoint_metadata())
    save_file(gemma_state_dict(), paths["text_encoder"])
    save_file(lora_state_dict(), paths["lora"])
    save_file(upsampler_state_dict(), paths["upscaler"], metadata={"config": json.dumps(UPSAMPLER)})
    paths["image"] = write_input_image(os.path.join(input_dir, INPUT_IMAGE))
    return paths


def main(argv):
    """python -m tools.tiny_models_ltx23 MODELS_DIR INPUT_DIR: write the set with ComfyUI 0.33.0 imported."""
    from .comfyui import LATEST, import_comfy
    import_comfy(LATEST)
    models_dir, input_dir = argv[1], argv[2]
    print(json.dumps(write_ltx23_model_set(models_dir, input_dir)))


if __name__ == "__main__":
    main(sys.argv)
