"""hetero's attachments to other training engines (FSDP2, Hugging Face), each an optional extra."""
