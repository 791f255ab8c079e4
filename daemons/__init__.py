"""The three daemons of the pipeline: reader (storage), dma (host→device staging), compute (GPU worker)."""
