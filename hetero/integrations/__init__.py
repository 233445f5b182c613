"""hetero inside other engines' loops: Lightning (the [lightning] extra), the Hugging Face Trainer and Accelerate
([hf]), Ray Train ([ray]). Each imports hetero.core only; FSDP2 is torch's own, so its support is in the core
(core/fsdp.py)."""
