"""Keys that the kohya_ss GUI (bmaltais/kohya_ss ``kohya_gui/lora_gui.py``, ``dreambooth_gui.py`` and
``finetune_gui.py`` ``train_model``, checked at 45088f04) writes into the ``--config_file`` TOML although the
sd-scripts script it runs (``train_network.py``, ``train_db.py``, ``fine_tune.py``, ``sdxl_train.py`` ...; 48d368fa)
has no such flag. sd-scripts ignores every unknown key silently; here a GUI key that changes nothing is accepted with
one info line, a GUI key that asks for a feature this trainer lacks is refused when set, and any other unknown key
stays an error with a did-you-mean. A key that is a flag of the script that reads the file is read as that flag
(``stop_text_encoder_training`` and ``no_token_padding`` of ``train_db.py``). The GUI drops every value that is "",
False or None before writing (the LoRA tab 0 too), so a key it writes is set."""

from __future__ import annotations

# GUI fields that never change training: the GUI also writes the flags that do.
GUI_ONLY_KEYS: dict[str, str] = {
    "epoch": "the GUI's Epoch box; when its Max train steps box is 0 the GUI turns it into max_train_steps, which it "
             "writes too",
    "noise_offset_type": "the GUI's noise menu; noise_offset / multires_noise_iterations are what set the noise",
    "stop_text_encoder_training": "the GUI's Stop TE slider, a flag of sd-scripts' train_db.py only: the other "
                                  "scripts train their text encoders throughout, as sd-scripts' do",
    "no_token_padding": "the DreamBooth tab's No token padding box (written for sdxl_train.py too), a flag of "
                        "sd-scripts' train_db.py that it reads nowhere",
    "learning_rate_te": "the DreamBooth and Finetune tabs' text encoder learning rate (written for every model but "
                        "SDXL), a flag of sd-scripts' fine_tune.py and train_db.py; flux_train.py and anima_train.py "
                        "train no text encoder, as sd-scripts' do not",
    "train_text_encoder": "the Finetune tab's Train text encoder box, a flag of sd-scripts' fine_tune.py and "
                          "sdxl_train.py; flux_train.py and anima_train.py train no text encoder, as sd-scripts' do "
                          "not",
    "show_timesteps_resolution": "the GUI's Show timesteps resolution box, read only with show_timesteps",
    **dict.fromkeys(
        ("compile_backend", "compile_mode", "compile_dynamic", "compile_fullgraph", "compile_cache_size_limit"),
        "an option of the GUI's Per-block Torch Compile, read only with compile"),
}

# What a GUI field that the GUI writes whatever the settings means when its tracker is off (``lora_gui.py`` writes
# ``wandb_run_name``, its "WANDB run name" box or else the output name, into every TOML): accepted with the info line.
GUI_TRACKER_KEYS: dict[str, str] = {
    "wandb_run_name": "the GUI's WANDB run name box (the output name when empty), written into every file; it names "
                      "a wandb run only with log_with = \"wandb\"",
}

# GUI fields for features of a newer sd-scripts that this trainer does not have: accepted when off, refused when on.
GUI_REFUSED_WHEN_SET: dict[str, str] = {
    "train_inpainting": "inpainting training (a 9-channel U-Net on random masks, in sd-scripts after 48d368fa) is not "
                        "supported here; untick \"Train inpainting model\" in the GUI, or remove the key",
    "compile": "per-block torch.compile of the DiT (sd-scripts after 48d368fa) is not provided here; untick "
               "\"Per-block Torch Compile\" in the GUI (or remove the key), or tick \"Legacy Torch Compile\" "
               "(torch_compile, which compiles the whole model here) instead",
    "qwen_image_vae_2d": "the 2D Qwen-Image VAE (sd-scripts after 48d368fa) is not provided here; untick \"Qwen-Image "
                         "VAE 2D\" in the GUI, or remove the key (vae_chunk_size saves the VAE's memory here)",
    "show_timesteps": "showing the sampled timesteps and exiting without training (sd-scripts after 48d368fa) is not "
                      "provided here; empty \"Show timesteps\" in the GUI, or remove the key",
}

# Keys the GUI writes for the scripts of upstream's that this trainer does not have (the scripts of ours name their
# own keys: ``FamilySpec.section``); a key of several scripts (sd-scripts 48d368fa: clip_l, t5xxl, ... of both
# flux_train_utils.py and sd3_train_utils.py) is listed under each.
OTHER_FAMILY_KEYS: dict[str, tuple[str, ...]] = {
    "SD3 (sd3_train_network.py)": (
        "apply_t5_attn_mask", "clip_g", "clip_g_dropout_rate", "clip_l", "clip_l_dropout_rate",
        "enable_scaled_pos_embed", "logit_mean", "logit_std", "mode_scale", "pos_emb_random_crop_rate", "save_clip",
        "save_t5xxl", "t5_dropout_rate", "t5xxl", "t5xxl_device", "t5xxl_dtype", "t5xxl_max_token_length",
        "text_encoder_batch_size", "weighting_scheme"),
    "DiT models (HunyuanImage, Lumina)": (
        "attn_mode", "blocks_to_swap", "byt5", "fp8_scaled", "fp8_vl", "gemma2", "gemma2_max_token_length",
        "sigmoid_scale", "split_attn", "system_prompt", "text_encoder", "text_encoder_cpu", "use_flash_attn",
        "use_sage_attn", "vae_chunk_size"),
}
