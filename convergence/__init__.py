"""surgery.convergence"""
