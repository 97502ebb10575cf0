"""The model: which ones the training path supports, the workers' ModelSpec, the DeepSpeed JSON, export.

    support.py           models the DACP path computes exactly; tokenizer/vocabulary checks (before Ray)
    spec.py              ModelSpec from the config's model section
    deepspeed_config.py  the DeepSpeed JSON generated from the config tree
    export.py            a run's checkpoint as a Hugging Face model directory (or a peft adapter)
    export_tokenizer.py  the run's tokenizer and chat template as Hugging Face tokenizer files
"""
