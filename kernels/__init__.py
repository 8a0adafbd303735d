"""portaserve.kernels"""
