//! pdnode-engine: The model engine: loaders (HF safetensors, GGUF, dummy), tokenizer and chat templates, sampling, the scheduler, and the Backend trait with CPU and CUDA backends.
