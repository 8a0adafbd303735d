"""portaserve.framework.testing"""
