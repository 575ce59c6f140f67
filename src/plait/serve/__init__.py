"""Serving: `plait serve` answers the Open Inference Protocol (KServe v2) with dynamic batching, replica
processes or pipeline stages, and text generation for GPT runs. See plait.serve.app for the endpoints."""
