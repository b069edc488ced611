"""The model: loading (torchvision names, model directories), the output kinds (heads,
readers, answers), the one compiled step, its compile checks, precision and ceiling."""
