"""Data and models for the demo, the examples and the command line: the digits shipped with
scikit-learn, image folders and torchvision data sets, timm/torchvision models by name. Optional:
``pip install private-engine[demo]`` (scikit-learn, torchvision); the engine never imports it."""
