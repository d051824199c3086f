"""EfficientNet image-classification training application.

Layout after NVIDIA DeepLearningExamples.
Subpackages: ``config`` (variants and the compound-scaling rules), ``model`` (the network),
later ``dataloader`` and ``runtime``.
"""
