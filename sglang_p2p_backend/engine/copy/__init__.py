"""Which bytes of which pages move, and the kernels that pack, unpack and copy them."""
