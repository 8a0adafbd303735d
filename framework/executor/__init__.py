"""portaserve.framework.executor"""
