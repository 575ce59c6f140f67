"""What is served: a model loaded from a run, an export or a Hugging Face directory, and where it runs.

It owns loading and the model's signature (`load`, `signature`: torch-free OIP tensor specs), the device choice
(`device`) and weight-only quantization (`quantize`). Every other room reads the loaded model from here.
"""
