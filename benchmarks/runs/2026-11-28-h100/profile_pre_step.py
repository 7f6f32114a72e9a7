import time, torch, cProfile, pstats, io
from torch import nn
from bnlab.optim import BNPreconditioner
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(3072,100), nn.ReLU(), nn.Linear(100,100), nn.ReLU(), nn.Linear(100,10)).cuda()
pre = BNPreconditioner(m)
x = torch.randn(256,3072,device="cuda"); y = torch.randint(0,10,(256,),device="cuda")
def fb():
    m.zero_grad(set_to_none=True); nn.functional.cross_entropy(m(x), y).backward()
for _ in range(5): fb(); pre.step()
torch.cuda.synchronize()
host, full = [], []
for _ in range(200):
    fb(); torch.cuda.synchronize()
    t = time.perf_counter(); pre.step(); host.append(time.perf_counter() - t)
    torch.cuda.synchronize(); full.append(time.perf_counter() - t)
host.sort(); full.sort()
print("pre.step host us", round(1e6 * host[100], 1), "with device us", round(1e6 * full[100], 1))
pr = cProfile.Profile()
for _ in range(200):
    fb(); torch.cuda.synchronize(); pr.enable(); pre.step(); pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14); print(s.getvalue()[:3500])
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as p:
    for _ in range(20):
        fb(); pre.step()
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=14))
