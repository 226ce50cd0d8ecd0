"""Names of what a run's output directory holds, shared by the modules that write it (open_sft.export.save, which
pulls in torch and peft) and those that only read it (the model card, the run's template variables)."""

MERGED_DIR = "merged"  # --merge_lora_on_save writes the full model here, inside --output_dir
