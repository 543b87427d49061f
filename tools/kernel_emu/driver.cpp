// Runs the chunked KDA prefill kernels of one kda_chunk.hip on the CPU
// emulation and writes out, state and record to a file.
#include <random>
int main(int argc, char** argv) {
    const int H = 2, dk = atoi(argv[1]), dv = atoi(argv[2]);
    std::vector<int> lens = {200, 64, 130};
    int T = 0; for (int l : lens) T += l;
    const int nseq = lens.size();
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> U(-1, 1);
    auto vec = [&](size_t n, float s) { std::vector<float> v(n); for (auto& x : v) x = s * U(rng); return v; };
    auto q = vec((size_t)T * H * dk, 1), k = vec((size_t)T * H * dk, 1), v = vec((size_t)T * H * dv, 1);
    auto g = vec((size_t)T * H * dk, 2), b = vec((size_t)T * H, 2), alog = vec(H, 0.5), dtb = vec((size_t)H * dk, 0.5);
    auto st = vec((size_t)nseq * H * dk * dv, 0.5);
    std::vector<float> out((size_t)T * H * dv, 0), rec((size_t)T * H * (2 * dk + dv), 0);
    std::vector<int> seg, cs;
    int row = 0, ch = 0;
    for (int i = 0; i < nseq; ++i) {
        seg.insert(seg.end(), {row, lens[i], ch, nseq - 1 - i});
        for (int c = 0; c < (lens[i] + 63) / 64; ++c) cs.push_back(i);
        row += lens[i]; ch += (lens[i] + 63) / 64;
    }
    const int chunks = ch;
    seg.insert(seg.end(), cs.begin(), cs.end());
    size_t rows = (size_t)H * chunks * 64;
    size_t ws_len = rows * (3 * 128 + dv) + (size_t)H * chunks * (64 * 64 + 128);
#ifdef NEW
    ws_len += (size_t)H * chunks * dv * 128;
#endif
    std::vector<float> ws(ws_len, std::nanf(""));
    launch({(unsigned)chunks, (unsigned)H, 1}, 256, [&] {
        kda_chunk_prep(q.data(), k.data(), v.data(), g.data(), b.data(), alog.data(), dtb.data(), rec.data(), ws.data(), seg.data(), nseq, H, dk, dv);
    });
#ifdef NEW
    launch({(unsigned)H, (unsigned)((dv + 15) / 16), (unsigned)nseq}, 256, [&] {
        kda_chunk_state(st.data(), ws.data(), seg.data(), chunks, H, dk, dv);
    });
    launch({(unsigned)chunks, (unsigned)H, (unsigned)((dv + 63) / 64)}, 256, [&] {
        kda_chunk_out(out.data(), rec.data(), ws.data(), seg.data(), nseq, H, dk, dv);
    });
#else
    launch({(unsigned)H, (unsigned)((dv + 15) / 16), (unsigned)nseq}, 256, [&] {
        kda_chunk_state(st.data(), out.data(), rec.data(), ws.data(), seg.data(), chunks, H, dk, dv);
    });
#endif
    FILE* f = fopen(argv[3], "wb");
    fwrite(out.data(), 4, out.size(), f); fwrite(st.data(), 4, st.size(), f); fwrite(rec.data(), 4, rec.size(), f);
    fclose(f);
    printf("T=%d chunks=%d out=%zu state=%zu rec=%zu\n", T, chunks, out.size(), st.size(), rec.size());
}
