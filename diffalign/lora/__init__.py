"""LoRA files: reading and writing the diffusers LoRA format (`io`), starting a run from a saved LoRA (`initial`) and
exporting a checkpoint for diffusers' ``load_lora_weights`` (`export`)."""
