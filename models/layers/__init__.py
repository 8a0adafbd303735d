"""portaserve.models.layers"""
