"""A deliberately broken plugin package (see README.md); nothing here is imported by portaserve itself."""
