#!/bin/bash
# Cycles per 64 bytes of the digest's hot loop by llvm-mca (LLVM 19), GCC 12 -O3 code.
# old_loop: (first+i+1)*G as written before ea1f4ff; new_loop: the running offset (digest version 1).
# v2 rows: the intrinsics loops of digest version 2 (mix2), taken from src/samebits/fingerprint/csrc/digest.c.
# Needs gcc and llvm-mca 19 (Debian: apt-get install gcc llvm-19). Writes nothing here: works in a temp dir.
set -e; here="$(cd "$(dirname "$0")" && pwd)"; work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
cp "$here"/loops.c "$here"/*.loop "$here"/../../src/samebits/fingerprint/csrc/digest.c "$work"; cd "$work"
extract() { python3 - "$1" "$2" <<'PY'
import sys,re
lines=open(sys.argv[1]).read().split('\n')
start=next(i for i,l in enumerate(lines) if re.match(re.escape(sys.argv[2])+r'(\.\w+\.\d+)?:$',l))  # GCC may clone: f.constprop.0
end=next(i for i in range(start,len(lines)) if lines[i].startswith('\t.size'))
body=lines[start:end]; best=None
labels={l[:-1]:i for i,l in enumerate(body) if re.match(r'^\.L\w+:$',l)}
for i,l in enumerate(body):
    m=re.match(r'^\t(jne|jb|ja|jnb|jbe)\t(\.L\w+)$',l)
    if m and m.group(2) in labels and labels[m.group(2)]<i:
        blk=[x for x in body[labels[m.group(2)]+1:i+1] if x.startswith('\t') and not x.startswith('\t.')]
        if best is None or len(blk)>len(best): best=blk
print('\n'.join(best))
PY
}
mca() { out=$(/usr/lib/llvm-19/bin/llvm-mca -march=x86-64 -mcpu=$2 -iterations=1000 $1 2>/dev/null)
  cyc=$(echo "$out" | awk '/Total Cycles:/{print $3}')
  python3 -c "print(f'{\"$1\":24s} {\"$2\":15s} {$cyc/1000/($3/64):6.2f} cycles/64B')"; }
gcc -O3 -S -march=x86-64-v4 -o v4.s loops.c            # AVX-512 zmm, vpmullq
gcc -O3 -S -march=x86-64-v4 -mno-avx512dq -o v4nodq.s loops.c   # vpmullq emulated by vpmuludq
gcc -O3 -S -march=x86-64-v4 -mprefer-vector-width=256 -o v4y.s loops.c
gcc -O3 -S -march=x86-64-v3 -o v3.s loops.c            # AVX2
for f in v4 v4nodq v4y v3; do for fn in old_loop new_loop; do extract $f.s $fn > $f.$fn.loop; done; done
for cpu in skylake-avx512 icelake-server sapphirerapids znver4; do
  mca v4.old_loop.loop $cpu 64; mca v4.new_loop.loop $cpu 64; mca v4nodq.new_loop.loop $cpu 64
  mca v4y.new_loop.loop $cpu 32; mca v3.old_loop.loop $cpu 32; mca v3.new_loop.loop $cpu 32
  mca sum_zmm.loop $cpu 256; mca cand.loop $cpu 64; done
mca v3.old_loop.loop znver3 32; mca v3.new_loop.loop znver3 32; mca sum_ymm.loop znver3 128
# Digest version 2: no -march; each loop carries its own target attribute.
gcc -O3 -S -o v2.s digest.c
# sum_words_avx512/avx2: the four-stream loops (4 lines = 256 bytes per iteration);
# sum_lines_*: the one-stream loops that take the tail (64 bytes per iteration).
for fn in sum_words_avx512 sum_lines_avx512 sum_words_avx2 sum_lines_avx2 sum_words_sse2; do
  extract v2.s $fn > v2.$fn.loop; done
for cpu in skylake-avx512 icelake-server sapphirerapids znver4; do
  mca v2.sum_words_avx512.loop $cpu 256; mca v2.sum_lines_avx512.loop $cpu 64
  mca v2.sum_words_avx2.loop $cpu 256; mca v2.sum_lines_avx2.loop $cpu 64; mca v2.sum_words_sse2.loop $cpu 32; done
for cpu in znver3 skylake alderlake; do
  mca v2.sum_words_avx2.loop $cpu 256; mca v2.sum_lines_avx2.loop $cpu 64; mca v2.sum_words_sse2.loop $cpu 32; done
