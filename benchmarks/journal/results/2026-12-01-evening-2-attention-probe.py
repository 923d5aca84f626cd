import time, torch, torch.nn.functional as F
from pipetune.model.kept_attention import _forward
dev = torch.device("cuda")
b, h, hk, s, d = 1, 32, 8, 131072, 128
q = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_(True)
k = torch.randn(b, s, hk, d, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_(True)
v = torch.randn(b, s, hk, d, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_(True)
try:
    from torch.backends.cuda import SDPAParams
    p = SDPAParams(q, k, v, None, 0.0, True, True)
    print("fused choice", torch._fused_sdp_choice(q, k, v, None, 0.0, True, enable_gqa=True))
except Exception as e:
    print("choice err", e)
def timed(name, fn, n=2):
    fn(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); print(f"{name}: {(time.perf_counter()-t)/n*1000:.1f} ms", flush=True)
go = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16)
def sdpa_fb():
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True); o.backward(go)
def sdpa_f():
    with torch.no_grad(): F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    sdpa_fb(); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6))
timed("sdpa fwd", sdpa_f); timed("sdpa fwd+bwd", sdpa_fb)
kept = _forward(q.detach(), k.detach(), v.detach(), None)
def mine_f(): _forward(q.detach(), k.detach(), v.detach(), None)
def mine_b():
    cq, ck, mq, mk, sd, off = kept.extra
    torch.ops.aten._scaled_dot_product_flash_attention_backward(go, q.detach(), k.detach(), v.detach(), kept.out, kept.logsumexp, cq, ck, mq, mk, 0.0, True, sd, off)
timed("flash fwd", mine_f); timed("flash bwd", mine_b)
out = kept.out
print("out stride", out.stride(), out.is_contiguous())
host = torch.empty_like(out, device="cpu", pin_memory=True)
print("pinned", host.is_pinned(), host.stride())
side = torch.cuda.Stream()
torch.cuda.synchronize(); t = time.perf_counter()
with torch.cuda.stream(side): host.copy_(out, non_blocking=True)
t1 = time.perf_counter(); side.synchronize(); t2 = time.perf_counter()
print(f"D2H 1 GiB strided: call {1000*(t1-t):.1f} ms, done {1000*(t2-t):.1f} ms")
back = torch.empty_like(host, device=dev)
t = time.perf_counter()
with torch.cuda.stream(side): back.copy_(host, non_blocking=True)
t1 = time.perf_counter(); side.synchronize(); t2 = time.perf_counter()
print(f"H2D 1 GiB: call {1000*(t1-t):.1f} ms, done {1000*(t2-t):.1f} ms")
t = time.perf_counter(); hs = [torch.empty_like(out, device="cpu", pin_memory=True) for _ in range(4)]; print(f"4 fresh pinned GiB: {1000*(time.perf_counter()-t):.0f} ms")
del hs
t = time.perf_counter(); hs = [torch.empty_like(out, device="cpu", pin_memory=True) for _ in range(4)]; print(f"4 cached pinned GiB: {1000*(time.perf_counter()-t):.0f} ms")
