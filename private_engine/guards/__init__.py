"""Guards: refuse, before anything is released, what the engine cannot clip exactly — unsupported
modules and parameters (:mod:`.model_check`), buffers written from the data (:mod:`.buffers`),
models or losses that mix samples (:mod:`.separability`)."""
